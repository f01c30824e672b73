"""Child process of tests/slime/test_slime_e2e.py: slime's rollout path against a real SGLang server.

Run as `python slime_rollout_driver.py <model_dir> <out.pt> <server.log>` in sglang_helpers.engine_env()
(SGLang needs the test-only sgl_kernel stand-in; it stays out of the pytest process) with slime and
TRACE_FP4_RECORD_STORE in the environment. It
  1. starts an SGLang HTTP server (`python -m sglang.launch_server`, CPU, trace_fp4 from the checkpoint's
     quantization_config, so the server puts each record in the store and returns its handle),
  2. parses slime's own command line (slime_helpers.slime_argv, with the README's TRACE flags),
  3. runs slime's `generate_and_rm_group` for every prompt group: slime dispatches to
     --custom-generate-function-path trace_slime.generate, which runs slime's SGLang `generate`;
     and slime's `generate_and_rm` for one evaluation sample,
  4. runs slime's `RolloutManager._convert_samples_to_train_data` and `_split_train_data_by_dp` (the
     real methods, on an instance made without `__init__`, which would launch GPU servers) into two
     data-parallel ranks through a local Ray, and slime's trainer-side `process_rollout_data` per rank,
  5. saves the Samples, each rank's rollout data and the first response's meta_info keys to <out.pt>.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

PROMPTS = ["one two three four", "the cat sat on", "five six", "a b c d e f g h i j"]
N_SAMPLES = 2
MAX_RESPONSE = 8
START_TIMEOUT_S = 420


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, port: int, log) -> subprocess.Popen:
    """Launch the server (returns at once; wait_ready waits for it)."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--device", "cpu",
           "--dtype", "bfloat16", "--mem-fraction-static", "0.05", "--max-total-tokens", "4096",
           "--chunked-prefill-size", "1024", "--max-running-requests", "16", "--disable-cuda-graph",
           "--random-seed", "0", "--log-level", "warning", "--host", "127.0.0.1", "--port", str(port),
           # as slime's SGLangEngine launches it (a warm-up request would leave a record nobody reads)
           "--skip-server-warmup"]
    env = dict(os.environ)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_ready(proc: subprocess.Popen, port: int) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the SGLang server exited with {proc.returncode} while starting (see its log)")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/model_info", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    proc.kill()
    raise RuntimeError(f"the SGLang server did not start within {START_TIMEOUT_S}s")


def rollout(args) -> list:
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm, generate_and_rm_group
    from slime.utils.http_utils import init_http_client
    from slime.utils.types import Sample

    init_http_client(args)
    state = GenerateState(args)
    groups, index = [], 0
    for g, prompt in enumerate(PROMPTS):
        group = []
        for _ in range(N_SAMPLES):
            group.append(Sample(group_index=g, index=index, prompt=prompt, label="1"))
            index += 1
        groups.append(group)

    async def run():
        train = await asyncio.gather(*[generate_and_rm_group(args, group, state.sampling_params.copy()) for group in groups])
        # an evaluation sample too: slime passes evaluation=True to a generate function that takes it
        held_out = await generate_and_rm(args, Sample(index=100, prompt=PROMPTS[0], label="1"),
                                         state.sampling_params.copy(), evaluation=True)
        return train, held_out

    train, held_out = asyncio.run(run())
    return [s for group in train for s in group], held_out


def convert_and_split(args, samples, dp_size: int):
    import ray
    from slime.ray.rollout import RolloutManager
    from slime.utils.data import process_rollout_data

    manager = object.__new__(RolloutManager.__ray_metadata__.modified_class)
    manager.args = args
    manager.custom_convert_samples_to_train_data_func = None
    manager.custom_reward_post_process_func = None
    train_data = manager._convert_samples_to_train_data(samples)
    manager.set_train_parallel_config({"dp_size": dp_size, "cp_size": 1, "vpp_size": 1,
                                       "microbatch_group_size_per_vp_stage": 1})
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        refs = manager._split_train_data_by_dp(train_data)
        ranks = [process_rollout_data(args, refs, r, dp_size) for r in range(dp_size)]
    finally:
        ray.shutdown()
    return train_data, ranks


def main(model_dir: str, out: str, server_log: str) -> None:
    import torch
    from slime_helpers import parse_slime_args, put_slime_on_path, slime_argv

    put_slime_on_path()
    import trace_slime.rollout

    port = _port()
    with open(server_log, "wb") as log:
        server = start_server(model_dir, port, log)
        try:
            # slime's parser runs while the server loads
            args = parse_slime_args(slime_argv(model_dir, num_layers=4, rollout_batch_size=len(PROMPTS),
                                               n_samples=N_SAMPLES, max_response_len=MAX_RESPONSE, max_tokens_per_gpu=40))
            args.sglang_router_ip, args.sglang_router_port = "127.0.0.1", port
            wait_ready(server, port)
            # One raw response too: what SGLang 0.5.23 returns to slime's request, key by key.
            body = json.dumps({"input_ids": [5, 6, 7], "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 2, "no_stop_trim": True,
                                                   "spaces_between_special_tokens": False}}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                raw = json.loads(r.read())
            from trace_kernels import stores
            from trace_sglang_plugin.transport import payload_from_meta_info

            # made outside slime: not a training record
            stores.delete(payload_from_meta_info(raw["meta_info"])["handle"])
            samples, held_out = rollout(args)
            train_data, ranks = convert_and_split(args, samples, dp_size=2)
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    torch.save({
        "samples": [{"index": s.index, "tokens": list(s.tokens), "response_length": s.response_length,
                     "rollout_log_probs": s.rollout_log_probs, "status": s.status.value,
                     "multimodal_train_inputs": s.multimodal_train_inputs} for s in samples],
        "held_out": {"response_length": held_out.response_length, "multimodal_train_inputs": held_out.multimodal_train_inputs},
        "train_data_keys": sorted(train_data),
        "ranks": ranks,
        "raw_response_keys": sorted(raw), "raw_meta_info_keys": sorted(raw["meta_info"]),
        "rollout_stats": trace_slime.rollout.rollout_stats(),
        "args": args,
    }, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
