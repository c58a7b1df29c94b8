"""``ep-fuse serve`` on a Qwen3-30B-A3B-sized model: real layer sizes, ``--layers`` of them, random bf16 weights.

Saves the model with a character-level tokenizer, starts the server through ``ep_fuse.serve.start`` (what
``ep-fuse serve`` runs; on CUDA with HF's CUDA graphs on), sends ``--requests`` concurrent chat completions and
plain completions with the OpenAI client, then generates the same prompts greedily with the eager model in this
process and reports how many answers agree token for token (random bf16 weights leave near-ties in the logits, so
agreement is reported, not required), the first-answer latency and the tokens/s of the concurrent batch.

    python experiments/2026-12/serve_real_size.py [--layers 4] [--requests 16] [--tiny --device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import string
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import transformers

from ep_fuse import serve

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<pad>", "<|im_end|>", "<unk>", "<|im_start|>"]
VOCAB = len(SPECIALS) + 95 + 1
"""The character-level tokenizer's size, also the model's: with Qwen3's 151936 a random model's argmax falls outside
the tokenizer and every answer decodes to "" (what the first H200 run of this script returned)."""
PROMPTS = ["hello world", "MoE", "the quick brown fox", "a", "Serve me, please!", "12345 67890", "ok", "zz top"]


def config(layers: int, tiny: bool) -> transformers.Qwen3MoeConfig:
    """Qwen3-30B-A3B's layer sizes (128 experts of I=768, top-8, 32 q / 4 kv heads of 128), ``layers`` layers."""
    if tiny:
        return transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                           num_experts=8, num_experts_per_tok=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, num_hidden_layers=layers,
                                           vocab_size=VOCAB, max_position_embeddings=2048)
    return transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                       num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                                       num_key_value_heads=4, head_dim=128, num_hidden_layers=layers,
                                       vocab_size=VOCAB, max_position_embeddings=4096, norm_topk_prob=True)


def save(path: str, layers: int, tiny: bool, device: str) -> transformers.PreTrainedModel:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(string.printable[:95]) + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                                unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config(layers, tiny), dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new", type=int, default=16, help="tokens per answer")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU dry run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "serve_real_size.json"))
    args = ap.parse_args()
    import openai

    res: dict = {"transformers": transformers.__version__, "torch": torch.__version__, "layers": args.layers,
                 "tiny": args.tiny}
    path = tempfile.mkdtemp(prefix="serve_real_size_")
    t0 = time.time()
    model = save(path, args.layers, args.tiny, args.device)
    res["save_s"] = time.time() - t0
    port = free_port()
    options = {"executor": "inductor"} if args.device == "cuda" else {"executor": "eager",
                                                                       "providers": {"cpu": ["reference"]}}
    t0 = time.time()
    srv = serve.start(path, options, host="127.0.0.1", port=port, device=args.device, dtype="bfloat16",
                      cb_num_blocks=256, cb_block_size=32, cb_max_batch_tokens=512)
    res["start_s"] = time.time() - t0  # load, prepare, both CB compiles and HF's warm-up / graph capture
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(args.requests)]

    def chat(p: str) -> tuple[str, float, int]:
        t = time.time()
        r = client.chat.completions.create(model=path, messages=[{"role": "user", "content": p}],
                                           max_tokens=args.new, temperature=0)
        return r.choices[0].message.content, time.time() - t, r.usage.completion_tokens if r.usage else 0

    try:
        t0 = time.time()
        first, res["first_request_s"], _ = chat(prompts[0])
        t0 = time.time()
        with ThreadPoolExecutor(args.requests) as pool:
            answers = list(pool.map(chat, prompts))
        wall = time.time() - t0
        res["concurrent_wall_s"] = wall
        res["requests"] = args.requests
        res["completion"] = client.completions.create(model=path, prompt=prompts[0], max_tokens=args.new,
                                                      temperature=0).choices[0].text
    finally:
        serve.stop(srv)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    agree, n_tokens = 0, 0
    for p, (text, _, n) in zip(prompts, answers):
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([list(ids)], device=args.device), max_new_tokens=args.new,
                                 do_sample=False)
        ref = tok.decode(out[0, len(ids):], skip_special_tokens=True)
        agree += ref == text
        n_tokens += n
    res.update(answered=sum(a is not None for a, _, _ in answers), agree_with_eager=agree,
               tokens_per_s=n_tokens / wall, latency_s=[round(t, 3) for _, t, _ in answers], first_answer=first)
    print(json.dumps(res, indent=1))
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
