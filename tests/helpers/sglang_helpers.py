"""Drive a real SGLang engine (CPU) for the trace_sglang_plugin tests, in a child process.

Why a child process: SGLang needs test-only stand-ins for `sgl_kernel` and `torchvision` on a CPU machine
(tests/helpers/sglang_stubs, see its README). Keeping SGLang out of the pytest process keeps those stand-ins
away from the other engines' tests that share the process. The child runs `sglang.Engine` in-process
(its scheduler and detokenizer are SGLang's own subprocesses) and answers calls over a local,
authenticated multiprocessing connection.

Also here: the tiny model, trace configs, and the forward-hook probe spec (tests/helpers/sglang_probe.py).
"""

import json
import os
import pickle
import secrets
import subprocess
import sys
import traceback
from importlib import metadata
from multiprocessing.connection import Client, Listener
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
REPO = HELPERS.parents[1]
STUBS = HELPERS / "sglang_stubs"
SGLANG_VERSION = "0.5.23"
START_TIMEOUT_S = 420


def sglang_skip_reason() -> str | None:
    """Why the SGLang tests cannot run here, or None."""
    try:
        version = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "sglang is not installed (see scripts/setup_venv.sh)"
    if version != SGLANG_VERSION:
        return f"sglang {version} installed; trace_sglang_plugin supports {SGLANG_VERSION}"
    eps = [ep for ep in metadata.entry_points(group="sglang.srt.plugins") if ep.value.startswith("trace_sglang_plugin")]
    if not eps:
        return "no sglang.srt.plugins entry point for trace_sglang_plugin (pyproject.toml / reinstall)"
    return None


# The tiny test models are Qwen3-MoE / Qwen3. SGLang imports every model module of its registry in each
# scheduler process (~30 s on a 2-core machine); skipping the others is a test-only speed-up.
TEST_MODEL_MODULES = ("qwen3_moe", "qwen3")


def _other_model_modules() -> str:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    models = Path(list(spec.submodule_search_locations)[0]) / "srt" / "models"
    names = sorted(p.stem for p in models.glob("*.py") if p.stem not in TEST_MODEL_MODULES and p.stem != "__init__")
    return ",".join(names)


def engine_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    paths = [str(STUBS), str(REPO), str(HELPERS)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env.setdefault("SGLANG_PLUGINS", "trace_fp4")
    env.setdefault("SGLANG_DISABLED_MODEL_ARCHS", _other_model_modules())
    env.update(extra or {})
    return env


def base_engine_kwargs(model_path, **overrides) -> dict:
    kw = dict(
        model_path=str(model_path),
        device="cpu",
        dtype="bfloat16",
        mem_fraction_static=0.05,
        max_total_tokens=4096,
        chunked_prefill_size=1024,
        max_running_requests=16,
        disable_cuda_graph=True,
        log_level="warning",
        random_seed=0,
    )
    kw.update(overrides)
    return kw


def probe_forward_hooks(probe_dir) -> list[dict]:
    """SGLang `forward_hooks` specs that dump the engine's own expert inputs and K/V (sglang_probe.py)."""
    cfg = {"dir": str(probe_dir)}
    return [
        {"name": "trace_probe_moe", "target_modules": ["model.layers.*.mlp.experts"],
         "hook_factory": "sglang_probe:moe_probe", "config": cfg},
        {"name": "trace_probe_attn", "target_modules": ["model.layers.*.self_attn.attn"],
         "hook_factory": "sglang_probe:attn_probe", "config": cfg},
    ]


def write_quantization_config(model_dir, quantization_config: dict | None) -> None:
    """Set (or remove) `quantization_config` in a tiny checkpoint's config.json."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    if quantization_config is None:
        cfg.pop("quantization_config", None)
    else:
        cfg["quantization_config"] = quantization_config
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


class EngineError(RuntimeError):
    pass


# Messages go through plain pickle: multiprocessing's own pickler would share tensor storage through
# file descriptors, which needs an authenticated side channel this pair of processes does not set up.
def _send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


class EngineProcess:
    """`with EngineProcess(kwargs) as eng: eng.call("generate", prompts, params)`."""

    def __init__(self, engine_kwargs: dict, env_extra: dict | None = None, log_path=None):
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        host, port = self.listener.address
        self.log_path = Path(log_path) if log_path else None
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", host, str(port)],
            env=engine_env(env_extra),
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(REPO),
        )
        self.proc.stdin.write(self.authkey.hex().encode() + b"\n")
        self.proc.stdin.close()
        self.conn = None
        self.ready = False
        try:
            self.listener._listener._socket.settimeout(START_TIMEOUT_S)
            self.conn = self.listener.accept()
            _send(self.conn, engine_kwargs)
            if not self.conn.poll(START_TIMEOUT_S):
                raise EngineError(f"engine did not start within {START_TIMEOUT_S}s{self._log_tail()}")
            status, value = _recv(self.conn)
        except EOFError as e:
            self.close()
            raise EngineError(f"engine process died while starting{self._log_tail()}") from e
        except BaseException:
            self.close()
            raise
        if status != "ready":
            self.close()
            raise EngineError(f"engine failed to start:\n{value}{self._log_tail()}")
        self.ready = True

    def _log_tail(self, n: int = 6000) -> str:
        if self.log_path and self.log_path.exists():
            return "\n--- engine log tail ---\n" + self.log_path.read_text(errors="replace")[-n:]
        return ""

    def call(self, method: str, *args, **kwargs):
        _send(self.conn, (method, args, kwargs))
        status, value = _recv(self.conn)
        if status != "ok":
            raise EngineError(f"{method} failed:\n{value}")
        return value

    def generate(self, prompts, sampling_params, **kwargs):
        return self.call("generate", prompts, sampling_params, **kwargs)

    def close(self):
        try:
            if self.ready and self.proc.poll() is None:
                _send(self.conn, ("shutdown", (), {}))
                self.conn.poll(60) and _recv(self.conn)
        except (OSError, EOFError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.listener.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _plain(value):
    """Results cross to the pytest process, which does not import SGLang: plain Python (and tensors) only."""
    import dataclasses

    import torch

    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.Tensor)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    fields = getattr(value, "__struct_fields__", None)  # msgspec structs
    if fields is not None:
        return {name: _plain(getattr(value, name)) for name in fields}
    return repr(value)


def _generate_and_abort(engine, prompt, sampling_params, abort_after_s: float):
    """Start one request, abort it after `abort_after_s` seconds; returns its (aborted) output."""
    import asyncio
    import uuid

    async def run():
        rid = uuid.uuid4().hex
        task = asyncio.ensure_future(engine.async_generate(prompt, sampling_params, rid=rid))
        await asyncio.sleep(abort_after_s)
        engine.tokenizer_manager.abort_request(rid)
        try:
            return await task
        except Exception as e:  # some versions raise for an aborted request instead of returning it
            return {"aborted_with": repr(e)}

    return engine.loop.run_until_complete(run())


def _serve(host: str, port: int) -> None:
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    conn = Client((host, port), authkey=authkey)
    kwargs = _recv(conn)
    try:
        import sglang

        engine = sglang.Engine(**kwargs)
    except BaseException:
        _send(conn, ("error", traceback.format_exc()))
        return
    _send(conn, ("ready", None))
    while True:
        method, args, kw = _recv(conn)
        if method == "shutdown":
            engine.shutdown()
            _send(conn, ("ok", None))
            return
        try:
            if method == "generate_and_abort":
                result = _generate_and_abort(engine, *args, **kw)
            elif method == "update_weights":
                # SGLang 0.5.23: updates run inside a session; end_weight_update runs
                # process_weights_after_loading on every quant method.
                engine.begin_weight_update()
                result = engine.update_weights_from_tensor(*args, **kw)
                engine.end_weight_update()
            else:
                result = getattr(engine, method)(*args, **kw)
            _send(conn, ("ok", _plain(result)))
        except BaseException:
            _send(conn, ("error", traceback.format_exc()))


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "serve":
    _serve(sys.argv[2], int(sys.argv[3]))
