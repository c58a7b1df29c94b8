"""Greedy requests for HF continuous-batching tests: the generation and CB configs, CB's outputs in request order, and
eager ``generate`` of the same prompts (the oracle)."""

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

NEW = 6
"""New tokens per request."""


def gen_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)


def cb_config(varlen=None, decode=None) -> ContinuousBatchingConfig:
    # a fixed request count per batch, as a server has: generate_batch otherwise sizes it to the workload,
    # and the padded cu_seq_lens change with it
    # (small pages: the KV read is padded to the whole cache)
    return ContinuousBatchingConfig(num_blocks=8, page_size=32, max_batch_tokens=64, max_requests_per_batch=8,
                                    varlen_compile_config=varlen, decode_compile_config=decode)


def tokens_of(out: dict) -> list[list[int]]:
    """``generate_batch``'s outputs in the order the requests were given."""
    return [out[k].generated_tokens for k in sorted(out, key=lambda r: int(r.rsplit("_", 1)[-1]))]


def eager_generate(model, prompts) -> list[list[int]]:
    """Eager ``generate`` of each prompt alone."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 generation_config=gen_config())
            outs.append(ids[0, len(p):].tolist())
    return outs
