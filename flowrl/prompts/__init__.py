"""Prompt sources: where the (prompt, metadata) pairs of training and evaluation come from, and the ``prompts``
section of a run that names them.

``prompts.dataset`` is a name in ``PROMPT_SOURCES``: flowrl's own (the embedded tasks, the shared evaluation
files, prompt files, local Hugging Face datasets), or a user's, added by an installed package's
``flowrl.prompts`` entry point, by ``flowrl.register_prompt_source`` or as an import path
``"my_pkg.data:prompts"``. A user's source is a function ``source(split) -> list of (prompt, metadata)`` (or of
plain prompt strings), called with ``prompts.train_split`` and ``prompts.eval_split``.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import Field, model_validator

from ..errors import FlowRLError, first_line, raised_at
from ..registry import Registry
from ..sections import Section

Prompt = tuple[str, dict[str, Any]]
Role = Literal["train", "eval"]
TRAIN_POOL_SIZE = 2000  # prompts drawn from a generated task or a shared evaluation file for training

PROMPT_SOURCES = Registry(
    "prompt source",
    "prompts.dataset",
    {
        "digits": "flowrl.prompts:_digits",
        "digits_video": "flowrl.prompts:_digits_video",
        "arith": "flowrl.prompts:_arith",
        "gsm8k": "flowrl.prompts:_shared_file",
        "math500": "flowrl.prompts:_shared_file",
        "countdown": "flowrl.prompts:_shared_file",
        "sudoku": "flowrl.prompts:_shared_file",
        "sudoku_compact": "flowrl.prompts:_sudoku_compact",
        "file": "flowrl.prompts:_prompt_file",
        "hf": "flowrl.prompts:_hf_dataset",
        "toy2d": "flowrl.prompts:_toy2d",
    },
    group="flowrl.prompts",
)


class DatasetColumns(Section):
    """``prompts.columns`` of a Hugging Face dataset (``dataset: hf``): which column is the prompt, which become
    metadata (None: every other column), which hold source images (None: the Image columns and one named "image")."""

    prompt: str = Field("prompt", description="The column holding the prompt.")
    metadata: list[str] | None = Field(None, description="Columns passed to the rewards as metadata; None: every other column.")
    images: list[str] | None = Field(None, description='Columns holding source images; None: the Image columns and one named "image".')


class PromptsConfig(Section):
    dataset: str = Field(
        "digits",
        description='Where prompts come from: a prompt source\'s name (digits, gsm8k, file, hf, ...) or an import path "pkg.module:function".',
    )
    eval_size: int = Field(200, ge=1, description="Held-out prompts drawn from a generated task or a shared evaluation file.")
    train_split: str = Field("train", description="The split training prompts are read from.")
    eval_split: str = Field("eval", description="The split held-out evaluation prompts are read from.")
    # "file": one prompt per line (.txt) or JSON lines with a "prompt" key, the other keys being metadata for the
    # rewards (.jsonl). "hf": a local Hugging Face dataset (parquet, arrow, jsonl, csv, a save_to_disk folder;
    # flowrl/prompts/datasets.py)
    train_file: str | None = Field(
        None, description='Training prompts of dataset "file" or "hf": a bundled name (flowrl/data/prompts/<name>) or a path.'
    )
    eval_file: str | None = Field(None, description='Evaluation prompts of dataset "file" or "hf", as train_file.')
    columns: DatasetColumns = Field(
        default_factory=DatasetColumns, description='Dataset "hf": which columns are the prompt, metadata and images.'
    )
    pairs: str | None = Field(
        None,
        description="Offline preference pairs (Diffusion-DPO, D3PO human labels): a directory from python -m flowrl.preferences.pairs.",
    )

    @model_validator(mode="after")
    def _source(self):
        if self.dataset not in PROMPT_SOURCES:
            raise ValueError(PROMPT_SOURCES.unknown(self.dataset))
        if self.dataset in ("file", "hf") and not (self.train_file and self.eval_file):
            raise ValueError(f"dataset '{self.dataset}' needs both train_file and eval_file")
        if self.dataset not in PROMPT_SOURCES.builtin_names():
            try:
                PROMPT_SOURCES.load(self.dataset)  # a user's module imports now, not after the model loaded
            except FlowRLError as e:
                raise ValueError(str(e).rstrip(".")) from None
        return self


def prompts_for(pc: PromptsConfig, role: Role) -> list[Prompt]:
    """The training (``role="train"``) or held-out (``"eval"``) (prompt, metadata) pairs of a run, in a fixed order."""
    split = pc.train_split if role == "train" else pc.eval_split
    if pc.dataset in PROMPT_SOURCES.builtin_names():
        return PROMPT_SOURCES.load(pc.dataset)(pc, role, split)
    return _user_source(pc.dataset, split)


def prompt_pool(dataset: str, split: str, size: int = TRAIN_POOL_SIZE, file: str | None = None) -> list[Prompt]:
    """The (prompt, metadata) pairs of one of flowrl's own sources: ``split`` of ``dataset`` (``size`` of them for the
    generated arith task and the shared evaluation files; ``file`` for dataset "file")."""
    pc = PromptsConfig.model_construct(dataset=dataset, eval_split=split, eval_size=size, eval_file=file, columns=DatasetColumns())
    return prompts_for(pc, "eval")  # as the held-out pool of a run whose eval_size is ``size``


def sample_prompts(pool: list[Prompt], n: int, rng: random.Random) -> list[Prompt]:
    return [pool[rng.randrange(len(pool))] for _ in range(n)]


# -- flowrl's own sources: (prompts section, role, split) -> pairs ------------------------------------------------
def _size(pc: PromptsConfig, role: Role) -> int:
    return TRAIN_POOL_SIZE if role == "train" else pc.eval_size


def _digits(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    from ..data.digits import prompt_set

    try:
        return prompt_set(split)
    except KeyError:
        raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'digits' (use train or eval).") from None


def _digits_video(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    """The embedded text-to-video model's prompts: "the digit three moving left"."""
    from ..data.digits_video import prompt_set

    try:
        return prompt_set(split)
    except KeyError:
        raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'digits_video' (use train or eval).") from None


def _arith(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    from ..data.arith import problems

    try:
        return problems(split, _size(pc, role) if split == "eval" else 4000, seed=0)
    except KeyError:
        raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'arith' (use train or eval).") from None


def _shared_file(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    """GSM8K, MATH500, Countdown, Sudoku: the shared evaluation files (FLOWRL_DATA_DIR)."""
    from ..data import text_tasks

    return getattr(text_tasks, f"load_{pc.dataset}")(limit=_size(pc, role))


def _sudoku_compact(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    """The embedded Sudoku LM's task: generated puzzles (train: none of them a test puzzle; seed 1, so not the
    puzzles sudoku_mdlm's SFT drew with seed 0) and the shared test file's (eval), both as 16 digits."""
    from ..data import sudoku

    if split not in ("train", "eval"):
        raise FlowRLError(f"prompt split '{split}' does not exist for dataset 'sudoku_compact' (use train or eval).")
    return sudoku.training_set(TRAIN_POOL_SIZE, seed=1) if split == "train" else sudoku.held_out(limit=_size(pc, role))


def _prompt_file(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    from .files import read_prompt_file

    return read_prompt_file(pc.train_file if role == "train" else pc.eval_file)


def _hf_dataset(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    """A local Hugging Face dataset; the split is the one asked for when set in the config, else the source's own
    choice ("train" when it has one, or its only split)."""
    from .datasets import read_dataset_prompts

    key = "train_split" if role == "train" else "eval_split"
    chosen = split if key in pc.model_fields_set else None
    c = pc.columns
    return read_dataset_prompts(
        pc.train_file if role == "train" else pc.eval_file,
        split=chosen,
        prompt_column=c.prompt,
        metadata_columns=c.metadata,
        image_columns=c.images,
    )


def _toy2d(pc: PromptsConfig, role: Role, split: str) -> list[Prompt]:
    return [("", {})]  # the unconditional 2-D toy: one empty prompt


def _user_source(name: str, split: str) -> list[Prompt]:
    """A user's ``source(split)``; each item a prompt string or a (prompt, metadata) pair, checked here."""
    fn = PROMPT_SOURCES.load(name)
    try:
        items = list(fn(split))
    except FlowRLError:
        raise
    except Exception as e:  # the user's line named, its traceback kept as the cause (flowrl train --debug prints it)
        line = raised_at(e, getattr(fn, "__module__", None) or "")
        raise FlowRLError(f"prompt source '{name}' failed for split '{split}' ({first_line(e)}{f', at {line}' if line else ''}).") from e
    pairs: list[Prompt] = []
    for i, item in enumerate(items):
        prompt, metadata = (
            (item, {}) if isinstance(item, str) else (tuple(item) + ({},))[:2] if isinstance(item, (tuple, list)) else (None, None)
        )
        if not isinstance(prompt, str) or not isinstance(metadata, dict):
            raise FlowRLError(
                f"prompt source '{name}' item {i} of split '{split}' is {item!r:.80}; each must be a prompt string or a "
                f"(prompt, metadata dict) pair."
            )
        pairs.append((prompt, dict(metadata)))
    if not pairs:
        raise FlowRLError(f"prompt source '{name}' gave no prompts for split '{split}'.")
    return pairs
