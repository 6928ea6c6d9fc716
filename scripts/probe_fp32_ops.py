import torch, traceback
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.rotary_embedding import get_rope
x = torch.randn(8, 256, device="cuda")
def t(name, f):
    try: f(); print("OK  ", name)
    except Exception as e: print("FAIL", name, str(e).splitlines()[0][:120])
n = RMSNorm(256).cuda()
t("rmsnorm", lambda: n(x))
t("fused_add_rmsnorm", lambda: n(x.clone(), x.clone()))
t("silu_and_mul", lambda: SiluAndMul()(torch.randn(8, 512, device="cuda")))
r = get_rope(64, 64, 4096, 10000, dtype=torch.float32).cuda()
t("rope", lambda: r(torch.arange(8, device="cuda"), torch.randn(8, 256, device="cuda"), torch.randn(8, 128, device="cuda")))
