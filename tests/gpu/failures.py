"""One process of a GPU failure job: runs failure scenarios (issue 8, "Tests on
the GPU machine") and prints one line ``JCG_RESULT {json}`` per scenario.

Usage: failures.py --scenarios a,b [--runs R] [--process-id I --num-processes N --port P]
With --num-processes > 1 each process drives one GPU (local_device_ids=[I]);
without, one process drives every GPU. test_gpu_failures.py launches the jobs,
sets each process's environment (JAX_COMM_GEMM_TIMEOUT and the like), kills the
victim of the "kill" scenario and asserts on the JSON lines.

Every scenario is bounded: a Guard dumps every thread's stack and leaves with
os._exit(3) when one does not finish in time, after printing its result line
with "hung": true; faulthandler bounds the whole process (JCG_HANG_DUMP_S).

Scenarios (M: one process per GPU, S: one process for all GPUs):
  disagree       M  connect with a setting that every process must share
                    (JAX_COMM_GEMM_TIMEOUT) set differently per process by the
                    parent: DisagreementError in both, before any collective.
  shapes         M  the fused AllGather+GEMM with a different token count on
                    each rank: the plan-mismatch error on both; the contexts stay
                    healthy; then the right call gives the right numbers.
  shapes_cached  M  the same, but after a warm-up: rank 0 calls the plan both
                    already agreed on (no agreement on its side) while rank 1
                    calls a new shape. What happens is recorded: an error on each
                    rank within the deadline, or right numbers; never silently
                    wrong numbers, never a hang.
  kill           M  fused MLP training steps; the parent SIGKILLs process 1 after
                    it prints KILL_MARKER. Process 0 records the project's error,
                    how it surfaced ("exception" from a call, or "poller": the
                    main thread still blocked GRACE_S after REGISTRY.contexts()
                    showed the error, then os._exit(3)) and whether the abort
                    released a wait that was blocked on the dead peer.
  one_rank       M  process 1's call is rejected by the handler (int32) before
                    any collective; process 0 calls a new plan and must get the
                    peer-timeout error within JAX_COMM_GEMM_TIMEOUT; then process
                    1 calls that plan too and must get an error, not hang.
  told           M  a planted allocation failure (tests/gpu/plant_alloc_failure.c,
                    preloaded into the victim's process only) in a pipelined_ce
                    call whose window grows: the victim's context aborts for its
                    own reason, and every peer's call ends within seconds with
                    "rank R failed: <that reason>" (jax_comm_gemm/runtime/peers.py),
                    not after JAX_COMM_GEMM_TIMEOUT. Each rank reports when and how.
  poll_growth    S  two threads poll REGISTRY.contexts() in a tight loop while the
                    main thread runs fused calls of growing shapes (new plans and
                    workspace growth, both collective): no deadlock.
  stress         MS stress.py: MLP forward+backward runs on fresh inputs, each
                    checked per row against a high-precision reference.

Longer than 300 lines because every failure scenario needs its own worker mode in one process entry point, which the test launches.
"""

from __future__ import annotations

import argparse
import faulthandler
import inspect
import json
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import local_device_ids  # noqa: E402

RESULT_PREFIX = "JCG_RESULT "
KILL_MARKER = "JCG_KILL_ME"
KILL_AFTER_STEPS = 20        # the victim asks to be killed after this many steps
GRACE_S = 10.0               # the main thread's time to surface an error the poller saw
KV_PREFIX = "jcg_failures"
HARD_EXIT = ("kill", "shapes_cached", "one_rank", "told")  # may leave a peer dead or stuck: exit without
                                      # jax.distributed's collective shutdown

PROCESS_START = time.time()
_state = {"pid": 0}


def log(msg: str) -> None:
  print(f"[process {_state['pid']}] {msg}", file=sys.stderr, flush=True)


def emit(scenario: str, result: dict) -> None:
  result = {"scenario": scenario, "process": _state["pid"], **result}
  print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


def error_text(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}"[:4000]


def distributed_kwargs(initialize, **wanted) -> dict:
  """The keyword arguments of `wanted` that this jax's initialize takes."""
  params = inspect.signature(initialize).parameters
  return {k: v for k, v in wanted.items() if k in params}


class Guard:
  """Bounds a scenario: past `seconds`, dumps every thread's stack, prints the
  scenario's result line (hung) and leaves with os._exit(3)."""

  def __init__(self, scenario: str, seconds: float, extra=None):
    self.scenario, self.seconds, self.extra = scenario, seconds, extra
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._watch, daemon=True)

  def _watch(self):
    if self._done.wait(self.seconds):
      return
    log(f"{self.scenario}: still running after {self.seconds:g} s; stacks:")
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    extra = {}
    try:
      extra = self.extra() if self.extra else {}
    except Exception as e:  # noqa: BLE001
      extra = {"extra_error": error_text(e)}
    emit(self.scenario, {"ok": False, "hung": True, "exit_path": "guard",
                         "error": f"did not finish within {self.seconds:g} s", **extra})
    sys.stderr.flush()
    os._exit(3)

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._done.set()
    self._thread.join(1.0)
    return False


class ErrorWatch:
  """Polls REGISTRY.contexts() for a context error. Once one shows, the main
  thread has GRACE_S to get past the phase it was in; if it has not, the
  result (`report()` plus what was seen) is printed and the process leaves
  with os._exit(3): a wait that the abort did not release."""

  def __init__(self, scenario: str, progress: dict, report, grace_s: float = GRACE_S,
               wait_for_peers_s: float = 0.0):
    self.scenario, self.progress, self.report, self.grace_s = scenario, progress, report, grace_s
    self.wait_for_peers_s = wait_for_peers_s
    self.t_error = None
    self.error = ""
    self.phase_at_error = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, daemon=True)

  def start(self):
    self._thread.start()
    return self

  def stop(self):
    self._stop.set()
    self._thread.join(2.0)

  def released(self) -> bool | None:
    """Whether the main thread left the phase it was in when the error showed."""
    if self.phase_at_error is None:
      return None
    return self.progress.get("counter") != self.phase_at_error[1]

  def _loop(self):
    from jax_comm_gemm.runtime import REGISTRY  # noqa: PLC0415
    while not self._stop.is_set():
      if self.t_error is None:
        errors = [c["error"] for c in REGISTRY.contexts() if c["error"]]
        if errors:
          self.t_error = time.time()
          self.error = errors[0]
          self.phase_at_error = (self.progress.get("phase"), self.progress.get("counter"))
          log(f"{self.scenario}: context error seen while the main thread was in "
              f"{self.phase_at_error[0]!r}: {self.error}")
      elif time.time() - self.t_error > self.grace_s and not self.released():
        log(f"{self.scenario}: main thread still in {self.phase_at_error[0]!r} "
            f"{self.grace_s:g} s after the context error; stacks:")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        emit(self.scenario, {**self.report(), "exit_path": "poller",
                             "t_error_seen": self.t_error, "context_error": self.error,
                             "main_phase_at_error": self.phase_at_error[0],
                             "main_released_after_error": False,
                             "abort_released_gpu_wait":
                                 False if self.phase_at_error[0] == "fetch" else None})
        finish(3, self.wait_for_peers_s)
      time.sleep(0.05)


def set_phase(progress: dict, phase: str) -> None:
  progress["phase"] = phase
  progress["counter"] = progress.get("counter", 0) + 1
  progress["since"] = time.time()


# --- exit ------------------------------------------------------------------------

def _kv_client():
  from jax._src import distributed  # noqa: PLC0415
  return distributed.global_state.client


def finish(code: int, wait_for_peers_s: float = 0.0) -> None:
  """Leaves now, skipping jax.distributed's shutdown barrier (a peer may be
  dead): says so in the key-value store, and process 0 (which hosts the
  coordination service) waits up to `wait_for_peers_s` for the others to say
  the same before it goes."""
  sys.stdout.flush()
  sys.stderr.flush()
  client = _kv_client() if _state.get("distributed") else None
  if client is not None:
    try:
      client.key_value_set(f"{KV_PREFIX}/exit/{_state['pid']}", str(code))
      if _state["pid"] == 0 and wait_for_peers_s > 0:
        for other in range(1, _state["nproc"]):
          client.blocking_key_value_get(f"{KV_PREFIX}/exit/{other}",
                                        int(wait_for_peers_s * 1000))
    except Exception as e:  # noqa: BLE001
      log(f"exit: {error_text(e)[:300]}")
  os._exit(code)


def bounded_registry_shutdown(seconds: float) -> dict:
  """REGISTRY.shutdown() on a thread, waited for at most `seconds`."""
  from jax_comm_gemm.runtime import REGISTRY  # noqa: PLC0415
  out = {}

  def run():
    start = time.perf_counter()
    try:
      REGISTRY.shutdown(timeout_s=seconds / 2)
      out["result"] = "returned"
    except Exception as e:  # noqa: BLE001
      out["result"] = error_text(e)
    out["seconds"] = round(time.perf_counter() - start, 2)

  t = threading.Thread(target=run, daemon=True)
  t.start()
  t.join(seconds)
  if t.is_alive():
    out["result"] = f"still running after {seconds:g} s"
  return out


# --- shared pieces --------------------------------------------------------------

def ag_fn(mesh, config):
  """jit(shard_map) of the fused AllGather+GEMM: x [n/P, k] -> [n, m/P]."""
  import jax_comm_gemm as jcg  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import checks  # noqa: PLC0415
  return checks.smap(mesh, lambda x, w: jcg.all_gather_matmul(x, w, "tp", config=config),
                     (P("tp"), P(None, "tp")), P(None, "tp"))


def ag_inputs(mesh, seed: int, local_rows: int, k: int = 512, m: int = 768):
  """(x, w, reference) of an AllGather+GEMM with `local_rows` tokens per rank,
  bf16, as this process sees the global shapes."""
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import checks  # noqa: PLC0415
  size = mesh.shape["tp"]
  x64 = checks.random(seed, local_rows * size, k)
  w64 = checks.random(seed + 1, k, m, scale=k**-0.5)
  x = checks.put(mesh, x64, P("tp"), jnp.bfloat16)
  w = checks.put(mesh, w64, P(None, "tp"), jnp.bfloat16)
  ref = (np.asarray(x64.astype(jnp.bfloat16), np.float64)
         @ np.asarray(w64.astype(jnp.bfloat16), np.float64))
  return x, w, ref


def timed_call(fn, *args) -> dict:
  """Runs fn(*args) to completion: {"error", "seconds", "t_end", "value"}."""
  import jax  # noqa: PLC0415
  start = time.perf_counter()
  out = {"error": None, "value": None}
  try:
    out["value"] = jax.block_until_ready(fn(*args))
  except Exception as e:  # noqa: BLE001
    out["error"] = error_text(e)
  out["seconds"] = round(time.perf_counter() - start, 3)
  out["t_end"] = time.time()
  return out


def contexts_summary() -> list[dict]:
  from jax_comm_gemm.runtime import REGISTRY  # noqa: PLC0415
  return [{k: c[k] for k in ("device", "rank", "workspace_bytes", "plans", "error")}
          for c in REGISTRY.contexts()]


# --- the scenarios ------------------------------------------------------------------

def scenario_disagree(ctx) -> dict:
  """connect() with a shared setting that differs between the processes."""
  import jax_comm_gemm as jcg  # noqa: PLC0415
  from jax_comm_gemm.runtime import settings  # noqa: PLC0415
  from jax_comm_gemm.runtime.agreement import DisagreementError  # noqa: PLC0415
  start = time.perf_counter()
  out = {"setting": os.environ.get(settings.CALL_TIMEOUT, "")}
  try:
    status = jcg.connect(ctx.mesh, "tp")
  except Exception as e:  # noqa: BLE001
    out.update(ok=isinstance(e, DisagreementError), raised=type(e).__name__,
               is_disagreement=isinstance(e, DisagreementError), message=str(e)[:3000])
  else:
    out.update(ok=False, raised=None, message=f"connect returned: {status.reason}")
  out["connect_seconds"] = round(time.perf_counter() - start, 2)
  out["t_error"] = time.time()
  out["contexts"] = contexts_summary()
  return out


def scenario_shapes(ctx) -> dict:
  """A different token count per rank on a new plan: the plan-mismatch error
  on both ranks, the contexts stay healthy, and the right call afterwards
  gives the right numbers, twice, bit-equal."""
  import jax_comm_gemm as jcg  # noqa: PLC0415

  import checks  # noqa: PLC0415
  f = ag_fn(ctx.mesh, checks.fused_config(ctx.mesh))
  bad_rows = 512 if ctx.pid == 0 else 768
  x, w, _ = ag_inputs(ctx.mesh, 40 + ctx.pid, bad_rows)
  mismatch = timed_call(f, x, w)
  out = {"local_rows": bad_rows, "mismatch_error": mismatch["error"],
         "mismatch_seconds": mismatch["seconds"], "contexts_after_mismatch": contexts_summary()}
  x, w, ref = ag_inputs(ctx.mesh, 42, 512)
  first, second = timed_call(f, x, w), timed_call(f, x, w)
  out["after_errors"] = [first["error"], second["error"]]
  if first["error"] is None and second["error"] is None:
    out["after_rel_err"] = checks.rel_err(first["value"], ref)
    out["after_bit_equal"] = checks.bit_equal(first["value"], second["value"])
  out["contexts_after"] = contexts_summary()
  tol = checks.TOLERANCE["bf16"]
  out["ok"] = bool(mismatch["error"] and "plan mismatch in the group" in mismatch["error"]
                   and out.get("after_rel_err", 1.0) < tol and out.get("after_bit_equal")
                   and not any(c["error"] for c in out["contexts_after"]))
  return out


def scenario_shapes_cached(ctx) -> dict:
  """After a warm-up plan that both ranks agreed on, rank 0 calls it again
  (cached on its side: no agreement) while rank 1 calls a new token count."""
  import jax  # noqa: PLC0415

  import jax_comm_gemm as jcg  # noqa: PLC0415

  import checks  # noqa: PLC0415
  f = ag_fn(ctx.mesh, checks.fused_config(ctx.mesh))
  x, w, ref = ag_inputs(ctx.mesh, 44, 512)
  warm = timed_call(f, x, w)
  out = {"warmup_error": warm["error"],
         "warmup_rel_err": checks.rel_err(warm["value"], ref) if warm["value"] is not None
         else None}
  if warm["error"]:
    return {**out, "ok": False}
  if ctx.pid != 0:
    x, w, ref = ag_inputs(ctx.mesh, 46, 768)
  out["local_rows"] = 512 if ctx.pid == 0 else 768
  progress = {}
  watch = ErrorWatch("shapes_cached", progress, lambda: dict(out, ok=False),
                     wait_for_peers_s=30.0).start()
  set_phase(progress, "call")
  start = time.time()
  # The call and the fetch are separate phases: the handler returns at once
  # when only the GPU waits, and the fetch then waits for the GPU.
  try:
    y = f(x, w)
    set_phase(progress, "fetch")
    y = jax.block_until_ready(y)
    out["error"] = None
    out["rel_err"] = checks.rel_err(y, ref)
  except Exception as e:  # noqa: BLE001
    out["error"] = error_text(e)
  set_phase(progress, "done")
  out["seconds"] = round(time.time() - start, 2)
  time.sleep(1.0)  # the watchdog's abort, if any, shows in contexts()
  watch.stop()
  out.update(exit_path="exception" if out["error"] else "returned",
             t_error_seen=watch.t_error, context_error=watch.error,
             main_phase_at_error=watch.phase_at_error and watch.phase_at_error[0],
             main_released_after_error=watch.released(),
             contexts=contexts_summary())
  wrong = out["error"] is None and not out["rel_err"] < checks.TOLERANCE["bf16"]
  aborted = any(c["error"] for c in out["contexts"])
  # Wrong numbers from a call that the watchdog aborted are followed by an
  # error at the next call; with a healthy context they would go unnoticed.
  out["wrong_numbers_then_aborted"] = wrong and aborted
  out["silently_wrong"] = wrong and not aborted
  out["ok"] = not out["silently_wrong"]
  return out


def _train_step(mesh, config, keep: bool, lr: float = 1e-3):
  """jit(shard_map) of one SGD step of the SP MLP on the project's collectives
  only (keep_gathered_input and a cuBLASMp reduce-scatter: no XLA collective
  that could hang on the dead peer first). Returns (w1, w2, local loss [P])."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import checks  # noqa: PLC0415
  from jax_comm_gemm import dense  # noqa: PLC0415

  def loss(w1, w2, x):
    y = dense.mlp(x, w1, w2, axis_name="tp", keep_gathered_input=keep, config=config)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  def step(w1, w2, x):
    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2, x)
    return w1 - lr * g1, w2 - lr * g2, value[None]

  return checks.smap(mesh, step, (P(None, "tp"), P("tp"), P("tp")),
                     (P(None, "tp"), P("tp"), P("tp")))


def scenario_kill(ctx) -> dict:
  """Training steps until process 1 is killed (by the parent): process 0
  reports how the project's error reached it."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import checks  # noqa: PLC0415
  import jax_comm_gemm as jcg  # noqa: PLC0415
  from jax_comm_gemm import hlo  # noqa: PLC0415
  from jax_comm_gemm.runtime import REGISTRY  # noqa: PLC0415
  n, d, f = 4096, 1024, 4096
  config = checks.fused_config(ctx.mesh, reduce_scatter="split_p2p")
  step = _train_step(ctx.mesh, config, keep=True)
  w1 = checks.put(ctx.mesh, checks.random(60, d, f, scale=d**-0.5), P(None, "tp"), jnp.bfloat16)
  w2 = checks.put(ctx.mesh, checks.random(61, f, d, scale=f**-0.5), P("tp"), jnp.bfloat16)
  xs = [checks.put(ctx.mesh, checks.random(62 + i, n, d), P("tp"), jnp.bfloat16)
        for i in range(4)]
  compiled = step.lower(w1, w2, xs[0]).compile()  # once; its HLO says what can hang
  counts = hlo.count_collectives(compiled.as_text())
  step = compiled
  out = {"role": "survivor" if ctx.pid == 0 else "victim",
         "call_timeout_s": REGISTRY.plan().settings.call_timeout_s,
         "collectives": str(counts),
         "distributed_kwargs": ctx.distributed_kwargs, "jax": jax.__version__}
  progress = {"step": 0}
  out_ref = out

  def report():
    return dict(out_ref, ok=True, steps=progress["step"])

  # JCG_NO_ERROR_WATCH: leave the survivor to the library's own sentinel.
  watched = ctx.pid == 0 and not os.environ.get("JCG_NO_ERROR_WATCH")
  watch = ErrorWatch("kill", progress, report).start() if watched else None
  cap_s = float(os.environ.get("JCG_KILL_CAP_S", "90"))
  start = time.time()
  error = None
  while time.time() - start < cap_s:
    try:
      set_phase(progress, "dispatch")
      w1, w2, loss = step(w1, w2, xs[progress["step"] % len(xs)])
      set_phase(progress, "fetch")
      value = float(np.asarray(loss.addressable_shards[0].data)[0])
    except Exception as e:  # noqa: BLE001
      error = e
      break
    progress["step"] += 1
    if progress["step"] == 1:
      out["loss_first"] = value
    if ctx.pid == 1 and progress["step"] == KILL_AFTER_STEPS:
      print(KILL_MARKER, flush=True)
      log(f"kill: step {progress['step']}, asked to be killed")
  t_end = time.time()
  phase_at_exception = progress.get("phase")
  set_phase(progress, "after_loop")
  if watch is not None:
    if error is not None:
      time.sleep(0.5)  # let the poller note the context error, if any
    watch.stop()
  out.update(steps=progress["step"])
  if error is None:
    out.update(ok=False, error=f"no error within {cap_s:g} s of training")
    return out
  message = error_text(error)
  phase_at_error = (watch.phase_at_error or (None,))[0] if watch else None
  out.update(ok=True, exit_path="exception", exception=message, t_exception=t_end,
             phase_at_exception=phase_at_exception,
             # The unknown of issue 8: did ncclCommAbort free the GPU work that
             # waited for the dead peer, so that a blocked fetch returned?
             abort_released_gpu_wait=True if phase_at_error == "fetch" else None,
             exception_is_project="jax_comm_gemm" in message,
             t_error_seen=watch.t_error if watch else None,
             context_error=watch.error if watch else "",
             main_phase_at_error=phase_at_error,
             main_released_after_error=watch.released() if watch else None,
             contexts=contexts_summary())
  return out


def scenario_one_rank(ctx) -> dict:
  """Process 1's call is rejected before any collective; process 0's new
  plan must fail within the deadline; then process 1's must too."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import checks  # noqa: PLC0415
  import jax_comm_gemm as jcg  # noqa: PLC0415
  from jax_comm_gemm.runtime import REGISTRY  # noqa: PLC0415
  from jax_comm_gemm.runtime.constants import TARGETS  # noqa: PLC0415
  deadline = REGISTRY.plan().settings.call_timeout_s
  f = ag_fn(ctx.mesh, checks.fused_config(ctx.mesh))
  x, w, ref = ag_inputs(ctx.mesh, 50, 512)
  warm = timed_call(f, x, w)
  out = {"call_timeout_s": deadline, "warmup_error": warm["error"]}
  if warm["error"]:
    return {**out, "ok": False}
  out["warmup_rel_err"] = checks.rel_err(warm["value"], ref)
  xb, wb, _ = ag_inputs(ctx.mesh, 52, 256)  # a plan neither rank has made yet
  client = _kv_client()
  done_key = f"{KV_PREFIX}/one_rank/peer_done"
  if ctx.pid == 1:
    size = ctx.mesh.shape["tp"]
    comm = REGISTRY.comm_id(ctx.mesh, "tp")

    def rejected(x, w):
      return jax.ffi.ffi_call(
          TARGETS["all_gather_matmul"],
          jax.ShapeDtypeStruct((x.shape[0] * size, w.shape[1]), x.dtype))(
              x, w, comm_id=np.int64(comm), transpose_w=False,
              algorithm=np.int64(
                  jcg.config.ALGORITHMS[checks.fused_config(ctx.mesh).all_gather_algorithm]),
              layout=np.int64(0))

    g = jax.jit(jax.shard_map(rejected, mesh=ctx.mesh, in_specs=(P("tp"), P(None, "tp")),
                              out_specs=P(None, "tp"), check_vma=False))
    xi = checks.put(ctx.mesh, checks.random(54, 512, 512), P("tp"), jnp.int32)
    wi = checks.put(ctx.mesh, checks.random(55, 512, 768), P(None, "tp"), jnp.int32)
    r = timed_call(g, xi, wi)
    out.update(rejected_error=r["error"], rejected_seconds=r["seconds"],
               contexts_after_rejection=contexts_summary())
    # Only once the peer has given up: a call now would meet its pending one.
    try:
      client.blocking_key_value_get(done_key, int((3 * deadline + 60) * 1000))
      out["peer_done"] = True
    except Exception as e:  # noqa: BLE001
      out["peer_done"] = error_text(e)[:300]
    # What is known so far, in case the follow-up ends the process (the sentinel).
    emit("one_rank_before_followup", dict(out))
    with Guard("one_rank", deadline + 40, lambda: dict(out)):
      follow = timed_call(f, xb, wb)
    out.update(followup_error=follow["error"], followup_seconds=follow["seconds"])
  else:
    with Guard("one_rank", deadline + 40, lambda: dict(out)):
      peer = timed_call(f, xb, wb)
    out.update(peer_error=peer["error"], peer_seconds=peer["seconds"])
    client.key_value_set(done_key, "1")
  out["contexts"] = contexts_summary()
  out["ok"] = True  # the test judges the messages and times
  return out


def scenario_told(ctx) -> dict:
  """Every rank calls a pipelined_ce AllGather+GEMM whose window (the gathered
  x, 128 MiB) the victim cannot get (JCG_PLANT_ALLOC_FAIL_FROM in its
  environment alone); each reports when its call ended and with what."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import jax_comm_gemm as jcg  # noqa: PLC0415
  config = jcg.CommGemmConfig(backend="cublasmp", all_gather_algorithm="pipelined_ce",
                              reduce_scatter="pipelined_ce")
  f = ag_fn(ctx.mesh, config)
  small = timed_call(f, *ag_inputs(ctx.mesh, 70, 256)[:2])  # a window every rank gets
  out = {"planted": bool(os.environ.get("JCG_PLANT_ALLOC_FAIL_FROM")),
         "warmup_error": small["error"]}
  n, k, m = 8192, 8192, 256 * ctx.mesh.shape["tp"]
  make = jax.jit(lambda: (jnp.ones((n, k), jnp.bfloat16), jnp.ones((k, m), jnp.bfloat16)),
                 out_shardings=(NamedSharding(ctx.mesh, P("tp")),
                                NamedSharding(ctx.mesh, P(None, "tp"))))
  x, w = make()
  # What is known so far, in case the sentinel ends the process in the call.
  emit("told_before_call", {**out, "t_call": time.time()})
  big = timed_call(f, x, w)
  out.update(error=big["error"], seconds=big["seconds"], t_end=big["t_end"],
             contexts=contexts_summary(), ok=True)  # the test judges the messages and times
  if out["planted"]:
    time.sleep(3.0)  # the herald publishes within a poll: stay until it has
  return out


def scenario_poll_growth(ctx) -> dict:
  """Tight polling of REGISTRY.contexts() from two threads while fused calls
  of growing shapes run on every GPU of this process."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from jax.sharding import NamedSharding  # noqa: PLC0415
  from jax.sharding import PartitionSpec as P  # noqa: PLC0415

  import checks  # noqa: PLC0415
  import jax_comm_gemm as jcg  # noqa: PLC0415
  from jax_comm_gemm.runtime import REGISTRY  # noqa: PLC0415
  mesh = ctx.mesh
  k, m = 4096, 1024
  sizes = tuple(int(s) for s in os.environ.get("JCG_GROWTH_TOKENS",
                                               "2048,8192,32768,65536").split(","))
  config = checks.fused_config(ctx.mesh, reduce_scatter="split_p2p")
  ag = checks.smap(mesh, lambda x, w: jcg.all_gather_matmul(x, w, "tp", config=config),
                   (P("tp"), P(None, "tp")), P(None, "tp"))
  rs = checks.smap(mesh, lambda x, w: jcg.matmul_reduce_scatter(x, w, "tp", config=config),
                   (P(None, "tp"), P("tp")), P("tp"))

  def inputs(n, seed):
    """x [n, k] P('tp'), w [k, m] P(None, 'tp') for the AllGather+GEMM and
    xr [n, k] P(None, 'tp'), wr [k, m] P('tp') for the GEMM+ReduceScatter."""
    specs = (P("tp"), P(None, "tp"), P(None, "tp"), P("tp"))

    def make(key):
      keys = jax.random.split(key, 4)
      shapes = ((n, k, 1.0), (k, m, k**-0.5), (n, k, 1.0), (k, m, k**-0.5))
      return tuple((jax.random.normal(kk, s[:2], jnp.float32) * s[2]).astype(jnp.bfloat16)
                   for kk, s in zip(keys, shapes))

    make = jax.jit(make, out_shardings=tuple(NamedSharding(mesh, s) for s in specs))
    return make(jax.random.PRNGKey(seed))  # an argument: nothing to constant-fold

  stats = {"polls": 0, "max_poll_s": 0.0, "last_poll": time.time(), "errors": [],
           "workspaces_seen": set()}
  lock = threading.Lock()
  stop = threading.Event()

  def poll():
    while not stop.is_set():
      t = time.perf_counter()
      try:
        infos = REGISTRY.contexts()
      except Exception as e:  # noqa: BLE001
        with lock:
          stats["errors"].append(error_text(e)[:300])
        continue
      dt = time.perf_counter() - t
      with lock:
        stats["polls"] += 1
        stats["max_poll_s"] = max(stats["max_poll_s"], dt)
        stats["last_poll"] = time.time()
        stats["workspaces_seen"].add(tuple(c["workspace_bytes"] for c in infos))
      time.sleep(0)  # no pause, but the main thread gets the GIL when it asks

  pollers = int(os.environ.get("JCG_GROWTH_POLLERS", "2"))
  threads = [threading.Thread(target=poll, daemon=True) for _ in range(pollers)]
  for t in threads:
    t.start()
  steps, rng = [], np.random.default_rng(70)

  def extra():
    with lock:
      return {"polls": stats["polls"], "steps": steps,
              "since_last_poll_s": round(time.time() - stats["last_poll"], 2)}

  with Guard("poll_growth", float(os.environ.get("JCG_GROWTH_GUARD_S", "120")), extra):
    for i, n in enumerate(sizes):
      start = time.perf_counter()
      x, w, xr, wr = inputs(n, 100 + i)
      y = jax.block_until_ready(ag(x, w))
      z = jax.block_until_ready(rs(xr, wr))
      rows = np.sort(rng.choice(n // 2, 16, replace=False))
      rows = np.concatenate([rows, rows + n // 2])  # both ranks' halves
      w64, wr64 = (np.asarray(a, np.float64) for a in (w, wr))
      errs = []
      for out_arr, x_arr, w_full in ((y, x, w64), (z, xr, wr64)):
        got = np.asarray(out_arr[rows], np.float64)
        want = np.asarray(x_arr[rows], np.float64) @ w_full
        errs.append(float(np.max(np.max(np.abs(got - want), axis=1)
                                 / np.max(np.abs(want), axis=1))))
      steps.append({"tokens": n, "seconds": round(time.perf_counter() - start, 2),
                    "ag_row_err": errs[0], "rs_row_err": errs[1],
                    "workspace_bytes": [c["workspace_bytes"] for c in REGISTRY.contexts()]})
      log(f"poll_growth: {steps[-1]}")
      del x, w, y, xr, wr, z
  stop.set()
  for t in threads:
    t.join(5.0)
  alive = sum(t.is_alive() for t in threads)
  with lock:
    seen = sorted(stats["workspaces_seen"])
    out = {"polls": stats["polls"], "max_poll_s": round(stats["max_poll_s"], 4),
           "poll_errors": stats["errors"][:5], "pollers_stuck": alive, "steps": steps,
           "workspace_sizes_seen_by_pollers": [list(s) for s in seen]}
  growth = len({tuple(s["workspace_bytes"]) for s in steps})
  out["distinct_workspace_sizes"] = growth
  tol = checks.TOLERANCE["bf16"] * 2
  out["ok"] = bool(alive == 0 and not stats["errors"] and stats["polls"] > 100 * min(pollers, 1)
                   and growth >= 3
                   and all(s["ag_row_err"] < tol and s["rs_row_err"] < tol for s in steps))
  return out


def scenario_stress(ctx) -> dict:
  import stress  # noqa: PLC0415
  return stress.run_stress(ctx.mesh, runs=ctx.runs)


SCENARIOS = {
    "disagree": scenario_disagree,
    "shapes": scenario_shapes,
    "shapes_cached": scenario_shapes_cached,
    "kill": scenario_kill,
    "one_rank": scenario_one_rank,
    "told": scenario_told,
    "poll_growth": scenario_poll_growth,
    "stress": scenario_stress,
}
NO_CONNECT = ("disagree",)  # they call connect themselves
GUARD_S = {"disagree": 60, "shapes": 90, "shapes_cached": 120, "kill": 200, "one_rank": 200,
           "told": 120,
           "poll_growth": 200, "stress": 240}


class Ctx:
  pass


def main(argv=None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--scenarios", required=True)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--runs", type=int, default=int(os.environ.get("JCG_STRESS_RUNS", "500")))
  args = parser.parse_args(argv)
  names = args.scenarios.split(",")
  unknown = [n for n in names if n not in SCENARIOS]
  if unknown:
    parser.error(f"unknown scenarios {unknown}; known: {sorted(SCENARIOS)}")
  _state.update(pid=args.process_id, nproc=args.num_processes,
                distributed=args.num_processes > 1)
  faulthandler.dump_traceback_later(float(os.environ.get("JCG_HANG_DUMP_S", "280")), exit=True)

  import jax  # noqa: PLC0415

  ctx = Ctx()
  ctx.pid, ctx.nproc, ctx.runs = args.process_id, args.num_processes, args.runs
  ctx.distributed_kwargs = {}
  if args.num_processes > 1:
    # A long heartbeat: the coordination service must not be the first to
    # notice a dead peer (the kill scenario measures the project's watchdog).
    ctx.distributed_kwargs = distributed_kwargs(
        jax.distributed.initialize, heartbeat_timeout_seconds=600, initialization_timeout=120)
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id,
                               local_device_ids=local_device_ids(args.process_id),
                               **ctx.distributed_kwargs)
  jax.config.update("jax_default_matmul_precision", "highest")
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  import jax_comm_gemm as jcg  # noqa: PLC0415
  ctx.mesh = Mesh(np.asarray(jax.devices()), ("tp",))
  log(f"start: {names}, {len(jax.devices())} devices, jax {jax.__version__}, "
      f"initialize kwargs {ctx.distributed_kwargs}, "
      f"{time.time() - PROCESS_START:.1f} s after start")
  connected = False
  for name in names:
    if name not in NO_CONNECT and not connected:
      start = time.perf_counter()
      try:
        status = jcg.connect(ctx.mesh, "tp")
      except Exception as e:  # noqa: BLE001
        for rest in names[names.index(name):]:
          emit(rest, {"ok": False, "error": f"connect: {error_text(e)}",
                      "traceback": traceback.format_exc()[-3000:]})
        break
      connected = True
      log(f"connect: {status.reason} ({time.perf_counter() - start:.1f} s)")
    start = time.perf_counter()
    try:
      with Guard(name, GUARD_S[name]):
        result = SCENARIOS[name](ctx)
    except Exception as e:  # noqa: BLE001
      result = {"ok": False, "error": error_text(e), "traceback": traceback.format_exc()[-3000:]}
    result["seconds_total"] = round(time.perf_counter() - start, 2)
    result["t_reported"] = time.time()
    emit(name, result)
    log(f"{name}: {'ok' if result.get('ok') else 'FAILED'} ({result['seconds_total']} s)")
  if any(n in HARD_EXIT for n in names):
    emit("exit", {"registry_shutdown": bounded_registry_shutdown(10.0)})
    # The kill's victim is dead: nobody to wait for.
    finish(0, wait_for_peers_s=0.0 if "kill" in names else 30.0)
  if args.num_processes > 1:
    jax.distributed.shutdown()  # all processes leave together


if __name__ == "__main__":
  main()
