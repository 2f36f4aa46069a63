"""Every command README.md and docs/ tell a user to type works on the install it follows.

Each command of a ```bash block is run for real, in the order its page gives, in a working directory of its own whose
`.venv` is what `make install` gives: flowrl and its core dependencies only (tests/core_install.py). It succeeds there,
or it fails in one sentence naming the extra it needs (`flowrl[NAME]`, which its page names too) with nothing written,
and then succeeds with that extra added. Files a page shows as blocks headed `# PATH` (a server's YAML, a user's
search module) are written first, as a reader would.

What is changed, and why: a training command runs one iteration of small groups (the budget overrides below) rather
than the preset's hours or minutes; a checkpoint a page names (`runs/NAME/checkpoints/step_000030`) is that run's newest,
made by its preset if the page did not make it; `runs/x` is a tiny FLUX.2 LoRA run (`flowrl tiny`); servers are
started, used as the page says and stopped. Commands that cannot run here are listed in ``NOT_RUN`` with the reason and
the test that covers them instead; a command without a rule fails the first test below.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO
from core_install import environment_variables, make_environment

SHARED = REPO.parent / "shared"
PAGES = ["README.md", *(str(p.relative_to(REPO)) for p in sorted((REPO / "docs").rglob("*.md")))]

# A training run of the page's command, at one iteration of two groups of the preset's size (every phase runs:
# rollout, reward, update, evaluation, checkpoint, summary). A real family's preset named without a checkpoint of the
# user's runs on a tiny random checkpoint of its family (`flowrl tiny`) with the overrides `flowrl tiny` prints.
TRAIN_BUDGET = "train.iterations=1 train.prompts_per_iteration=2 eval.samples_per_prompt=1 prompts.eval_size=2 log.progress=false"
EVAL_BUDGET = "eval.samples_per_prompt=1 prompts.eval_size=2"
# Scripts that train from scratch: the same script, a few steps.
SCRIPT_BUDGET = {"flowrl.pipelines.embedded.train_digits_video": "--steps 2"}

# Checks whose exit status is their verdict: after a one-iteration run the verdict may be "not yet" (exit 1), and the
# command has worked when it printed its verdict line.
VERDICTS = {"flowrl.evaluation.toy2d": '"passed": '}

# Commands not run here: (pattern, why, what covers them instead).
NOT_RUN: list[tuple[str, str]] = [
    (r"^make install\b", "builds the environment this test runs commands in (tests/core_install.py makes the same one)"),
    (r"^make test\b", "runs this suite (CI's .ci/run)"),
    (r"^pip install\b", "installs an extra: each command needing one is run without it, then with it"),
    (r"^(vllm|python -m sglang)\b", "another project's judge server on a GPU (tests/test_openai_judge.py runs transformers serve)"),
    (r"--num_processes (8|16)\b", "8-16 GPUs and a hub checkpoint (tests/test_distributed.py runs FSDP2 and ZeRO-3 on 2 CPU processes)"),
    (r"scripts/record_goldens\.py", "rewrites the repository's goldens (tests/test_frozen_bits.py checks them)"),
    (r"\bbench/", "a benchmark that regenerates documented numbers, minutes to hours (bench/RESULTS.md)"),
    (r"--push-to-hub", "publishes to the Hugging Face Hub, unreachable here (tests/test_model_card.py builds the card)"),
]


@dataclass
class Command:
    page: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def _strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a `#` starting a word outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def page_commands(page: str) -> list[Command]:
    """The commands of the page's ```bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", (REPO / page).read_text(), flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            text = _strip_comment(line).strip()
            if text:
                commands.append(Command(page, text))
    return commands


def page_files(page: str) -> dict[str, str]:
    """Files the page shows whole: a ```yaml or ```python block whose first line is `# PATH`."""
    files = {}
    for body in re.findall(r"```(?:yaml|python)\n(.*?)```", (REPO / page).read_text(), flags=re.S):
        first = body.splitlines()[0] if body else ""
        match = re.fullmatch(r"# ([\w/]+\.(?:yaml|py))", first.strip())
        if match:
            files[match.group(1)] = body
    return files


def not_run_reason(command: Command) -> str | None:
    return next((why for pattern, why in NOT_RUN if re.search(pattern, command.text)), None)


def _runs_flowrl(text: str) -> bool:
    """The command runs flowrl (its CLI, a module of it, or an export of a variable for one)."""
    if re.match(r"^export \w+=", text):
        return True  # set for the page's later commands
    return bool(re.match(r"^((\.venv/bin/)?(flowrl|python)|accelerate launch|torchrun)\b", text)) and "flowrl" in text


ALL = [c for page in PAGES for c in page_commands(page)]


def test_every_documented_command_is_run_or_says_why_not():
    assert len(ALL) > 60
    unruled = [str(c) for c in ALL if not not_run_reason(c) and not _runs_flowrl(c.text)]
    assert not unruled, "commands with no way to check them (add a NOT_RUN rule or make them runnable):\n" + "\n".join(unruled)


def test_the_pages_name_the_files_they_show():
    """The page's `# PATH` blocks this test writes (so a command reading one finds it)."""
    assert "server.yaml" in page_files("docs/reward_server.md")
    assert "my_pkg/searches.py" in page_files("docs/inference_scaling.md")


# ------------------------------------------------------------------------------------------------ the workspace


class Environments:
    """The core install and the core plus extras, each made once for the module (tests/core_install.py)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[str, ...], Path] = {}

    def bin(self, extras: tuple[str, ...]) -> Path:
        if extras not in self.made:
            self.made[extras] = make_environment(self.root / ("env_" + "_".join(extras or ("core",))), extras)
        return self.made[extras]


class Workspace:
    """A user's fresh working directory for one page, beside ../shared (when this checkout has it), with `.venv`
    pointing at the core install or the core plus extras."""

    def __init__(self, root: Path, environments: Environments) -> None:
        self.dir = root / "main"
        self.dir.mkdir(parents=True)
        for name in ("configs", "bench", "scripts"):
            (self.dir / name).symlink_to(REPO / name)
        if SHARED.is_dir():
            (root / "shared").symlink_to(SHARED)
        self.environments = environments
        self.tiny_run: str | None = None

    def use(self, extras: tuple[str, ...]) -> Path:
        """Point `.venv` at the environment with ``extras``; its bin directory."""
        bin_dir = self.environments.bin(extras)
        link = self.dir / ".venv"
        if link.is_symlink():
            link.unlink()
        link.symlink_to(bin_dir.parent)
        return bin_dir

    def files(self) -> set[str]:
        return {str(p.relative_to(self.dir)) for p in self.dir.rglob("*") if not str(p.relative_to(self.dir)).startswith(".venv")}

    def shell(self, text: str, extras: tuple[str, ...] = (), timeout: float = 900) -> subprocess.CompletedProcess:
        env = environment_variables(self.use(extras))
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        return subprocess.run(["bash", "-c", text], cwd=self.dir, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def environments():
    with tempfile.TemporaryDirectory(prefix="flowrl_envs_") as root:
        yield Environments(Path(root))


@pytest.fixture
def workspace(environments, tmp_path):
    return Workspace(tmp_path, environments)


# ------------------------------------------------------------------------------------------------ rewrites


def preset_with_output(name: str) -> str | None:
    """The preset whose output_dir is runs/NAME."""
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        if re.search(rf"^output_dir: runs/{re.escape(name)}\s*$", path.read_text(), flags=re.M):
            return str(path.relative_to(REPO))
    return None


def ensure_run(ws: Workspace, name: str) -> None:
    """runs/NAME exists: a page may name a run another page (or the preset's own command) makes."""
    if (ws.dir / "runs" / name).is_dir():
        return
    if name == "x":
        ensure_tiny_run(ws)
        return
    preset = preset_with_output(name)
    assert preset, f"no preset writes runs/{name}, which a page names"
    done = ws.shell(f"flowrl train {preset} {TRAIN_BUDGET}")
    assert done.returncode == 0, done.stderr[-3000:]


def ensure_tiny_run(ws: Workspace) -> str:
    """The tiny FLUX.2 klein-base LoRA run docs/model_families.md makes with `flowrl tiny`, as runs/x."""
    if ws.tiny_run is None:
        made = ws.shell("flowrl tiny flux2 tiny_klein_x --variant klein-base")
        assert made.returncode == 0, made.stderr[-3000:]
        train = next(line.strip() for line in made.stdout.splitlines() if line.strip().startswith("flowrl train"))
        done = ws.shell(re.sub(r"output_dir=\S+", "", train) + " output_dir=runs/x", extras=("lora",))
        assert done.returncode == 0, done.stderr[-3000:]
        ws.tiny_run = "runs/x"
    return ws.tiny_run


def tiny_family_overrides(ws: Workspace, text: str) -> str | None:
    """For `flowrl train PRESET` of a real family without a checkpoint of the user's: a tiny checkpoint of the preset's
    family made with `flowrl tiny` (once per page), and the overrides that run the preset on it."""
    from flowrl.pipelines.tiny.runs import RUNS, tiny_overrides

    match = re.search(r"\btrain\s+(?:configs/)?([\w/]+?)(?:\.yaml)?(?:\s|$)", text)
    if match is None or match.group(1) not in RUNS or "pipeline.pretrained=" in text:
        return None
    run = RUNS[match.group(1)]
    checkpoint = f"tiny_{run.family}_{run.variant}".replace("-", "_").replace(".", "_")
    if not (ws.dir / checkpoint).is_dir():
        made = ws.shell(f"flowrl tiny {run.family} {checkpoint} --variant {run.variant}")
        assert made.returncode == 0, made.stderr[-3000:]
    return " ".join(shlex.quote(o) for o in tiny_overrides(match.group(1), checkpoint))


def newest_checkpoint(ws: Workspace, name: str) -> str:
    ensure_run(ws, name)
    steps = sorted((ws.dir / "runs" / name / "checkpoints").glob("step_*"))
    assert steps, f"runs/{name} has no checkpoint"
    return f"runs/{name}/checkpoints/{steps[-1].name}"


def _insert_after_source(text: str, verb: str, words: str) -> str:
    """``words`` after the first argument of the flowrl ``verb`` (before any option, so argparse reads them as
    overrides)."""
    return re.sub(rf"(\bflowrl(?:\.cli)?\s+{verb}\s+\S+)", rf"\1 {words}", text, count=1)


def rewrite(ws: Workspace, text: str, printed: list[str]) -> str:
    """The command as run here (see the module docstring)."""
    if "..." in text and printed:  # "the overrides it printed": the command the previous one printed
        text = printed[-1]
    text = re.sub(r"runs/([\w.-]+)/checkpoints/step_\d+", lambda m: newest_checkpoint(ws, m.group(1)), text)
    for name in re.findall(r"\bruns/([\w.-]+)/summary\.json", text):
        ensure_run(ws, name)
    if re.search(r"\bflowrl(\.cli)?\s+train\b", text):
        text = _insert_after_source(text, "train", tiny_family_overrides(ws, text) or TRAIN_BUDGET)
    elif re.search(r"\bflowrl\s+eval\s+(?!--spec)\S+", text) and not re.search(r"\beval\s+\S+\.jsonl\b", text):
        text = _insert_after_source(text, "eval", EVAL_BUDGET)
    for module, budget in SCRIPT_BUDGET.items():
        if module in text:
            text += " " + budget
    if text.startswith("accelerate launch"):
        text = text.replace("accelerate launch", f"accelerate launch --main_process_port {free_port()}", 1)
    if text.startswith("torchrun"):
        text = text.replace("torchrun", f"torchrun --master_port {free_port()}", 1)
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ running


SERVERS = re.compile(r"^(\.venv/bin/)?flowrl (serve-reward|label)\b")


def serve(ws: Workspace, exports: list[str], text: str, extras: tuple[str, ...]) -> subprocess.CompletedProcess:
    """Start a server command, wait for the address it prints, use it as its page says, stop it (SIGINT:
    Ctrl-C); the process's outcome. A server that exits at once (a refusal) is returned as it ended."""
    env = environment_variables(ws.use(extras))
    script = "; ".join([*exports, "exec " + text])  # exec: the signal reaches the server, not a shell
    proc = subprocess.Popen(["bash", "-c", script], cwd=ws.dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        first = proc.stdout.readline()
        if "http://" in first:
            break
    if proc.poll() is None:
        url = re.search(r"http://[^\s/]+/?\S*", first).group(0)
        if " label " in f" {text} ":
            label_every_pair(url)
        else:
            with urllib.request.urlopen(re.sub(r"(http://[^/\s]+).*", r"\1/health", url), timeout=30) as answer:
                assert answer.status == 200
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as the pages say
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(text, proc.returncode, first + out, err)


def label_every_pair(url: str) -> None:
    """A person's clicks on the labelling page: 'left' on every pair, through the page's own API."""
    import json

    base = re.match(r"http://[^/\s]+", url).group(0).replace("localhost", "127.0.0.1")
    with urllib.request.urlopen(base + "/api/state", timeout=30) as answer:
        total = json.loads(answer.read())["progress"]["total"]
    for pair in range(total):
        request = urllib.request.Request(
            base + "/api/label",
            data=json.dumps({"pair": pair, "choice": "left"}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 200


def run_command(ws: Workspace, exports: list[str], text: str, extras: tuple[str, ...]) -> subprocess.CompletedProcess:
    if SERVERS.search(text):
        return serve(ws, exports, text, extras)
    return ws.shell("; ".join([*exports, text]), extras)


def check_on_the_install_it_follows(ws: Workspace, command: Command, exports: list[str], text: str) -> subprocess.CompletedProcess:
    """Run on the core install; on failure it must name an extra in one sentence, write nothing, the page must name
    the extra, and the command must then succeed with it."""
    before = ws.files()
    done = run_command(ws, exports, text, ())
    if done.returncode == 0 or (done.returncode == 1 and any(m in text and v in done.stdout for m, v in VERDICTS.items())):
        return done
    named = re.findall(r"flowrl\[(\w+)\]", done.stderr)
    assert named, f"{command} failed on the core install without naming an extra:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, f"{command}: a traceback, not one sentence:\n{done.stderr[-3000:]}"
    assert ws.files() == before, f"{command} wrote {sorted(ws.files() - before)[:5]} before failing for flowrl[{named[0]}]"
    page_text = (REPO / command.page).read_text()
    assert f"flowrl[{named[0]}]" in page_text, f"{command.page} does not name flowrl[{named[0]}], which `{command.text}` needs"
    done = run_command(ws, exports, text, (named[0],))
    assert done.returncode == 0, f"{command} with flowrl[{named[0]}] failed:\n{done.stderr[-3000:]}"
    return done


RUNNABLE_PAGES = [p for p in PAGES if any(_runs_flowrl(c.text) and not not_run_reason(c) for c in page_commands(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_the_commands_of_a_page_work_on_the_install_they_follow(page, workspace):
    ws = workspace
    for path, body in page_files(page).items():
        (ws.dir / path).parent.mkdir(parents=True, exist_ok=True)
        (ws.dir / path).write_text(body)
        if path.endswith(".py"):
            (ws.dir / path).parent.joinpath("__init__.py").touch()
    exports: list[str] = []
    printed: list[str] = []
    for command in page_commands(page):
        if not_run_reason(command):
            continue
        if command.text.startswith("export "):
            exports.append(command.text)
            continue
        if "../shared/data" in command.text and not SHARED.is_dir():
            continue  # as the suite's other readers of ../shared/data: absent beside a clone outside the project
        done = check_on_the_install_it_follows(ws, command, exports, rewrite(ws, command.text, printed))
        printed += [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("flowrl train")]
