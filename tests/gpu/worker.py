"""One process of a GPU test job: runs checks.py's checks on a ('tp',) mesh
over all the job's GPUs and prints each check's result as one JSON line
(JCG_CHECK) as soon as the check ends.

Usage: worker.py --checks a,b,c [--repeat R] [--process-id I --num-processes N --port P]
With --num-processes > 1 each process drives one GPU (local_device_ids=[I]), or,
in the shared-GPU mode (JCG_GPU_SHARED, tests/gpu/machine.py), all share GPU 0.
A check that cannot run there reports "skipped" with the reason.
"""

import argparse
import faulthandler
import json
import logging
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--checks", required=True)
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--num-processes", type=int, default=1)
  parser.add_argument("--port", type=int, default=0)
  parser.add_argument("--repeat", type=int, default=1, help="run the checks this many times")
  args = parser.parse_args()
  # A hang shows where it is: every thread's stack, before the job's timeout.
  faulthandler.dump_traceback_later(float(os.environ.get("JCG_HANG_DUMP_S", "240")), exit=True)

  import jax  # noqa: PLC0415
  from machine import local_device_ids  # noqa: PLC0415

  # autotune says what it measures (and, with JCG_AUTOTUNE_DEBUG=1, each batch).
  logging.basicConfig(stream=sys.stderr, format="[%(asctime)s] %(message)s")
  logging.getLogger("jax_comm_gemm.autotune").setLevel(
      logging.DEBUG if os.environ.get("JCG_AUTOTUNE_DEBUG") else logging.INFO)

  if args.num_processes > 1:
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                               process_id=args.process_id,
                               local_device_ids=local_device_ids(args.process_id))
  # fp32 comparisons against float64 need XLA's reference path without TF32.
  jax.config.update("jax_default_matmul_precision", "highest")
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  import checks  # noqa: PLC0415
  from examples import launch  # noqa: PLC0415
  import jax_comm_gemm as jcg  # noqa: PLC0415

  mesh = Mesh(np.asarray(jax.devices()), ("tp",))
  start = time.perf_counter()
  status = jcg.connect(mesh, "tp")  # collective: communicators, agreement, self-test
  print(f"[process {args.process_id}] connect: {status.reason} "
        f"({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
  names = args.checks.split(",")
  runs = [(n, n if args.repeat == 1 else f"{n}#{i}") for i in range(args.repeat) for n in names]
  for check, name in runs:
    start = time.perf_counter()
    try:
      result = {"ok": True, "details": checks.CHECKS[check](mesh)}
    except checks.NeedsDistinctGpus as e:
      result = {"ok": True, "skipped": str(e)}
    except Exception as e:  # noqa: BLE001  (reported per check)
      result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:3000],
                "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.perf_counter() - start, 2)
    # Each result as soon as it is known: a later hang must not take it along.
    print("JCG_CHECK " + json.dumps({"name": name, **result}, default=str), flush=True)
    print(f"[process {args.process_id}] {name}: {'ok' if result['ok'] else 'FAILED'} "
          f"({result['seconds']} s)", file=sys.stderr, flush=True)
  if args.num_processes > 1:
    del mesh
    launch.leave()  # together, and without error lines at exit


if __name__ == "__main__":
  main()
