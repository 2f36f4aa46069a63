"""Rewards, objectives, model families and prompt sources from a user's package, outside the repository.

The package is written to a temporary directory with a real ``*.dist-info`` (what ``pip install`` writes, so
``importlib.metadata`` finds its entry points), put on the Python path, and named from configs three ways: by
import path, by entry point, and by ``flowrl.register_*``. The objective is the worked example of
docs/architecture.md ("Adding an objective"), read from the page itself, so the page cannot drift from the code.
Bad plug-ins (a wrong path, a missing attribute, a wrong signature, a wrong output shape) are one sentence raised
before any model loads: their runs name a model directory that does not exist, so an error about the reward proves
the model was never reached.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO, fast_overrides

from flowrl.config import load_config
from flowrl.errors import FlowRLError

SCORES = '''
import torch

def sharpness(samples, prompts, metadata):
    """Mean absolute horizontal gradient: one score per sample."""
    return (samples[..., 1:] - samples[..., :-1]).abs().flatten(1).mean(1)

class Brightness:
    """A reward class: built with reward.kwargs, then called."""
    required_metadata = ("digit",)

    def __init__(self, target: float = 0.5):
        self.target = target

    def __call__(self, samples, prompts, metadata):
        return [-abs(float(x) - self.target) for x in samples.flatten(1).mean(1)]

def one_argument(samples):
    return samples.mean()

def per_pixel(samples, prompts, metadata):
    return samples.flatten(1)

def raises(samples, prompts, metadata):
    raise RuntimeError("the scorer is offline")

not_callable = 3
'''

PROMPTS = """
def sevens(split):
    return [("a handwritten seven", {"digit": 7}), ("the digit 7", {"digit": 7})] if split == "train" else [("seven", {"digit": 7})]
"""

FAMILY = '''
from typing import Any, ClassVar

from flowrl.pipelines.digits import DigitsConfig, DigitsPipeline


class SmallDigits(DigitsPipeline):
    """The embedded digits model under another family name (a user's adapter subclass)."""


class SmallDigitsConfig(DigitsConfig):
    """pipeline.name: my_ext.family:SmallDigitsConfig."""

    name: str = "small_digits"
    adapter: ClassVar[Any] = SmallDigits
'''


def architecture_example() -> str:
    """The python block under "Adding an objective" in docs/architecture.md, as written there."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("## Adding an objective") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def ext(tmp_path_factory):
    """my_ext on sys.path, with entry points for a reward, an objective, a family and a prompt source."""
    root = tmp_path_factory.mktemp("outside")
    pkg = root / "my_ext"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text(SCORES)
    (pkg / "prompts.py").write_text(PROMPTS)
    (pkg / "family.py").write_text(FAMILY)
    (pkg / "rwr.py").write_text(architecture_example())
    info = root / "my_ext-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-ext\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""\
        [flowrl.rewards]
        sharpness = my_ext.scores:sharpness
        [flowrl.objectives]
        rwr = my_ext.rwr:RWRConfig
        [flowrl.pipelines]
        small_digits = my_ext.family:SmallDigitsConfig
        [flowrl.prompts]
        sevens = my_ext.prompts:sevens
        """)
    )
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == "my_ext" or m.startswith("my_ext.")]:
        del sys.modules[name]


@pytest.mark.slow
def test_import_paths_name_every_kind_of_part(ext, tmp_path, one_thread):
    from flowrl.trainer import Trainer

    config = load_config(
        None,
        fast_overrides(
            tmp_path / "run",
            **{
                "reward.components": "{'my_ext.scores:sharpness': 1.0, 'my_ext.scores:Brightness': 0.5}",
                "reward.kwargs": "{'my_ext.scores:Brightness': {target: 0.4}}",
                "objective": "{name: 'my_ext.rwr:RWRConfig', temperature: 0.5}",
                "pipeline.name": "my_ext.family:SmallDigitsConfig",
                "prompts.dataset": "my_ext.prompts:sevens",
                "pipeline.device": "cpu",
                "log.trackers": "[]",
            },
        ),
    )
    assert type(config.objective).__name__ == "RWRConfig" and config.objective.temperature == 0.5
    trainer = Trainer(config)
    assert type(trainer.pipeline).__name__ == "SmallDigits" and trainer.objective.name == "rwr"
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    out = trainer.reward(x, ["seven"] * 3, [{"digit": 7}] * 3)
    sharp = (x[..., 1:] - x[..., :-1]).abs().flatten(1).mean(1)
    torch.testing.assert_close(out.extras["my_ext.scores:sharpness"], sharp)
    torch.testing.assert_close(out.extras["my_ext.scores:Brightness"], -(x.flatten(1).mean(1) - 0.4).abs())
    torch.testing.assert_close(out.scores, sharp - 0.5 * (x.flatten(1).mean(1) - 0.4).abs())
    before = {k: v.clone() for k, v in trainer.pipeline.trainable_state_dict().items()}
    summary = trainer.fit()
    assert summary["status"] == "completed"
    after = trainer.pipeline.trainable_state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)  # the user's objective trained every weight
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {"reward/my_ext.scores:sharpness", "reward/my_ext.scores:Brightness", "loss/policy"} <= set(rows[1])
    written = load_config(tmp_path / "run" / "config.yaml")  # config.yaml names the plug-ins and loads again
    assert written.objective.name == "my_ext.rwr:RWRConfig" and written.pipeline.name == "my_ext.family:SmallDigitsConfig"


@pytest.mark.slow
def test_entry_points_from_an_installed_package_from_the_command_line(ext, tmp_path):
    """A separate process, started outside the repository, finds the package's entry points by name."""
    import os

    preset = tmp_path / "mine.yaml"
    preset.write_text(
        "reward: {components: {sharpness: 1.0}}\nobjective: {name: rwr, temperature: 2.0}\n"
        "pipeline: {name: small_digits, device: cpu}\nprompts: {dataset: sevens}\n"
    )
    overrides = fast_overrides(tmp_path / "run", **{"log.trackers": "[]"})
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ext), str(REPO)]), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", "train", str(preset), *overrides],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "reward/sharpness" in rows[1]


def test_registered_names_and_entry_points_are_listed(ext):
    import flowrl
    from flowrl.objectives import OBJECTIVES
    from flowrl.reward_models import REWARDS

    assert "sharpness" in REWARDS.names() and "rwr" in OBJECTIVES.names()
    flowrl.register_reward("double_ink", lambda samples, prompts, metadata: 2 * samples.flatten(1).mean(1))
    try:
        config = load_config(None, ["reward.components={double_ink: 1.0}"])
        from flowrl.reward_models import build_reward_from_config

        scores = build_reward_from_config(config.reward)(torch.full((2, 1, 8, 8), 0.25), ["", ""], [{}, {}]).scores
        assert scores.tolist() == [0.5, 0.5]
        with pytest.raises(FlowRLError, match="already registered"):
            flowrl.register_reward("double_ink", abs)
    finally:
        REWARDS.unregister("double_ink")
    with pytest.raises(FlowRLError, match="one of flowrl's own"):
        REWARDS.unregister("ink")


MISSING_MODEL = "/nonexistent/model"  # a run that got as far as loading its model would fail on this instead


@pytest.mark.parametrize(
    "components,needle",
    [
        (
            "{'no_such_pkg.scores:sharpness': 1.0}",
            "config key 'reward' is invalid: reward 'no_such_pkg.scores:sharpness' cannot be imported "
            "(no module named 'no_such_pkg' on the Python path; is its package installed?).",
        ),
        ("{'my_ext.scores:sharpnes': 1.0}", "reward 'my_ext.scores:sharpnes': module 'my_ext.scores' has no attribute 'sharpnes'."),
        ("{unknown_name: 1.0}", "unknown reward 'unknown_name'; choose one of: digit_classifier"),
        (
            "{'my_ext.scores:one_argument': 1.0}",
            "reward 'my_ext.scores:one_argument' cannot be called as fn(samples, prompts, metadata): "
            "its signature is (samples) (too many positional arguments).",
        ),
        (
            "{'my_ext.scores:not_callable': 1.0}",
            "reward 'my_ext.scores:not_callable' is a int, not a callable fn(samples, prompts, metadata).",
        ),
        (
            "{'my_ext.scores:per_pixel': 1.0}",
            "reward 'my_ext.scores:per_pixel' returned scores of shape (2, 64) for 2 samples; it must return "
            "one score per sample, shape (2,).",
        ),
        (
            "{'my_ext.scores:raises': 1.0}",
            "reward 'my_ext.scores:raises' failed on a probe batch of (2, 1, 8, 8) before training (RuntimeError: the scorer is offline).",
        ),
    ],
)
def test_a_bad_plugin_is_one_sentence_before_any_model_loads(ext, tmp_path, capsys, components, needle):
    from flowrl.cli import main

    code = main(
        [
            "train",
            "digits/grpo",
            f"output_dir={tmp_path / 'run'}",
            f"reward.components={components}",
            f"pipeline.pretrained={MISSING_MODEL}",
            "log.trackers=[]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("flowrl: error: ") and err.count("\n") == 1, err
    assert needle in err, err
    assert MISSING_MODEL not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["reward.components={'my_ext.scores:Brightness': 1.0}", "reward.kwargs={'my_ext.scores:Brightness': {tarket: 0.3}}"],
            "unknown config key 'reward.kwargs.my_ext.scores:Brightness.tarket'.",
        ),
        (
            ["reward.components={'my_ext.scores:Brightness': 1.0}", "reward.kwargs={'my_ext.scores:Brightness': {target: bright}}"],
            "config key 'reward.kwargs.my_ext.scores:Brightness.target' is invalid: input should be a valid number",
        ),
        (
            ["objective={name: 'my_ext.rwr:RWRConfig', temperature: -1}"],
            "config key 'objective.temperature' is invalid: input should be greater than 0",
        ),
        (
            ["objective={name: 'my_ext.rwr:NoSuchConfig'}"],
            "config key 'objective.name' has an unknown value: objective 'my_ext.rwr:NoSuchConfig': "
            "module 'my_ext.rwr' has no attribute 'NoSuchConfig'.",
        ),
        (
            ["pipeline.name=my_ext.scores:sharpness"],
            "config key 'pipeline.name' has an unknown value: pipeline.name 'my_ext.scores:sharpness' is a function",
        ),
        (
            ["prompts.dataset=my_ext.prompts:nothing"],
            "config key 'prompts' is invalid: prompt source 'my_ext.prompts:nothing': module 'my_ext.prompts' has no attribute 'nothing'.",
        ),
    ],
)
def test_a_bad_plugin_config_is_refused_when_the_config_loads(ext, overrides, needle):
    with pytest.raises(FlowRLError) as e:
        load_config(None, overrides)
    assert needle in str(e.value), str(e.value)
