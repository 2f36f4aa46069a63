"""Train the embedded block-diffusion math LM (arith_bd3lm) and write it where flowrl ships it.

    python -m flowrl.pipelines.embedded.train_arith_bd3lm [--steps 500] [--block-length 4] [--out flowrl/assets/arith_bd3lm]

The same task and SFT data as arith_mdlm (``train_arith.py``: the arithmetic problems, 30% of the solutions with an
answer one off), but the model is a block-diffusion LM (BD3-LM / SDAR style) so that generation can keep the prompt
and the finished blocks in an exact key-value cache: a tiny ``transformers.LlamaForCausalLM`` (a decoder class, so
its attention takes a cache and a custom 4-D mask; not Qwen2, for which transformers 5's AutoTokenizer replaces the
saved word-level tokenizer by Qwen2's own) trained with block-causal attention
(``pipelines/block_attention.py``): each block of ``block_length`` tokens attends to itself fully and to the blocks
before it, never to a later one. The config records ``diffusion_block_length``, which is how ``load_masked_lm``
knows to apply that attention.

Training is BD3-LM's vectorised form: input ``[prompt ; x_t ; x_0]``, each completion block noised at its own
masking rate t ~ U(0, 1) (at least one masked token per row), every noised block attending to the clean earlier
blocks and itself; the loss is the mean cross-entropy of the masked tokens (as train_arith, LLaDA's SFT form without
the 1/t weight). So each block learns to be denoised given the clean prefix it has at sampling time.

Writes the model, its tokenizer and ``training_info.json`` into one directory; deterministic for a seed and thread count.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ...data.arith import COMPLETION_LEN, PROMPT_LEN, build_tokenizer, vocabulary
from ..block_attention import block_diffusion_training_mask, block_diffusion_training_positions
from .train_arith import fit_on_problems
from .training import ASSETS, parse_training_arguments, training_parser


def build_model(block_length: int, hidden: int = 96, layers: int = 3, heads: int = 4, *, tokenizer=None, vocab_size: int | None = None):
    """arith_bd3lm's architecture, a LlamaForCausalLM run with block-causal attention (the shipped size by default;
    flowrl tiny builds it smaller). ``tokenizer`` and ``vocab_size``: another task's (the Sudoku one's); None: arith's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
    config = LlamaConfig(
        vocab_size=len(vocabulary()) if vocab_size is None else vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    config.diffusion_block_length = block_length  # read by flowrl's load_masked_lm: block-causal attention
    config.mask_token_id = tokenizer.mask_token_id
    return LlamaForCausalLM(config)


def block_diffusion_loss(block_length: int, prompt_len: int = PROMPT_LEN, completion_len: int = COMPLETION_LEN):
    """BD3-LM's vectorised loss on a batch of encoded problems (``prompt_len`` prompt tokens, then ``completion_len``
    completion tokens; arith's by default): ``[prompt ; x_t ; x_0]`` with each completion block masked at its own
    rate t ~ U(0, 1) (at least one masked token per row), block-causal training attention, the mean cross-entropy of
    the masked tokens."""
    P, G, num_blocks = prompt_len, completion_len, completion_len // block_length

    def batch_loss(model, tokenizer, x: torch.Tensor, attention_mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        batch_size = x.shape[0]
        prompt, prompt_mask, x0 = x[:, :P], attention_mask[:, :P], x[:, P:]
        t = torch.rand(batch_size, num_blocks, generator=gen).repeat_interleave(block_length, 1)  # one rate per block
        masked = torch.rand(batch_size, G, generator=gen) < t
        masked[torch.arange(batch_size), torch.randint(0, G, (batch_size,), generator=gen)] = True
        x_t = torch.where(masked, tokenizer.mask_token_id, x0)
        logits = model(
            input_ids=torch.cat([prompt, x_t, x0], 1),
            attention_mask=block_diffusion_training_mask(prompt_mask, G, block_length, torch.float32),
            position_ids=block_diffusion_training_positions(prompt_mask, G),
        ).logits[:, P : P + G]
        return torch.nn.functional.cross_entropy(logits[masked], x0[masked])

    return batch_loss


def train(out: Path, steps: int, batch_size: int, lr: float, seed: int, num_problems: int, flaw_rate: float, block_length: int) -> None:
    if COMPLETION_LEN % block_length:
        raise SystemExit(f"--block-length {block_length} must divide the completion length {COMPLETION_LEN}")
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "train_problems": num_problems, "flaw_rate": flaw_rate}
    command = (
        f"python -m flowrl.pipelines.embedded.train_arith_bd3lm --steps {steps} --batch-size {batch_size} --lr {lr} --seed {seed} "
        f"--flaw-rate {flaw_rate} --block-length {block_length} --threads {torch.get_num_threads()}"
    )
    make_model = functools.partial(build_model, block_length)
    fit_on_problems(out, "arith_bd3lm", make_model, block_diffusion_loss(block_length), settings, {"block_length": block_length}, command)


def main() -> None:
    p = training_parser(__doc__, out=ASSETS / "arith_bd3lm", steps=500, batch_size=64, lr=2e-3)
    p.add_argument("--problems", type=int, default=4000)
    p.add_argument("--flaw-rate", type=float, default=0.3, help="fraction of SFT solutions whose final answer is one off")
    p.add_argument("--block-length", type=int, default=4)
    a = parse_training_arguments(p)
    train(a.out, a.steps, a.batch_size, a.lr, a.seed, a.problems, a.flaw_rate, a.block_length)


if __name__ == "__main__":
    main()
