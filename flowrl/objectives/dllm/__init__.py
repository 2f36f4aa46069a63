"""Objectives for masked diffusion language models (docs/math.md section 6).

Every dLLM RL method (d1's diffu-GRPO, MMaDA's UniGRPO (paper-derived here: no training code was released),
DiffuCoder's coupled-GRPO, DCoLT/LLaDOU, BGPO, TraceRL) differs mainly in how it estimates the policy's
log-likelihood of a sampled completion, which a masked diffusion model does not give in closed form.
``estimators.py`` holds those estimators as pure, seeded callables
``estimator(lm, traj, seed_index) -> EstimatorOutput(token_log_probs, weights)`` with the sequence-level estimate
``(weights * token_log_probs).sum(-1)``; ``plackett_luce.py`` holds DCoLT's per-step action log-probability
(Plackett-Luce over unmasked positions + chosen tokens).
"""
