import logging, sys, torch, transformers, ep_fuse, ep_fuse.kernel_analysis as ka
print("installed:", ka.__file__, "has _kernel_id:", hasattr(ka, "_kernel_id"))
h = logging.StreamHandler(sys.stdout); lg = logging.getLogger("ep_fuse"); lg.addHandler(h); lg.setLevel(logging.DEBUG)
from ep_fuse import tiny_models
model = ep_fuse.prepare(tiny_models.build("qwen3_moe", dtype=torch.bfloat16, device="cuda", seed=1))
model.generation_config.pad_token_id = 0
ids = torch.randint(1, 128, (4, 12), device="cuda")
with torch.no_grad():
    model.generate(ids, max_new_tokens=2, do_sample=False, cache_implementation="static",
                   compile_config=transformers.CompileConfig(backend="ep_fuse", mode="default"))
print(ep_fuse.reports()[0].kernel_analyses)
