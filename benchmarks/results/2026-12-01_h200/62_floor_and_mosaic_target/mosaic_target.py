"""One-off (run 62): the compiled HLO's custom-call target of a Mosaic GPU
kernel on this GPU, and what diagnostics.hlo counts of it."""
import re
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as mm
from jax_comm_gemm.backends import pallas
from jax_comm_gemm.diagnostics import hlo

_, config = pallas._kernel()
a = jnp.ones((1024, 512), jnp.bfloat16)
b = jnp.ones((512, 1024), jnp.bfloat16)
try:
  f = jax.jit(lambda a, b: mm.matmul(a, b, None, config))
  text = f.lower(a, b).compile().as_text()
except TypeError:
  f = jax.jit(lambda a, b: mm.matmul(a, b, config))
  text = f.lower(a, b).compile().as_text()
print("targets:", sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))))
print("counts:", hlo.count_collectives(text))
print("max abs err:", float(jnp.max(jnp.abs(f(a, b).astype(jnp.float32) - 512.0))))
