# The README's commands. Each builds .venv first (scripts/setup_venv.sh, idempotent).
.PHONY: setup test test-fast align bench rl-miniature

# The CPU native kernels are compiled into their disk cache here, not in the first test (or rollout) that
# calls each one: ~2.5 min on 2 cores when the kernel sources changed, ~5 s to load when they did not.
setup:
	bash scripts/setup_venv.sh
	.venv/bin/trace-fp4 compile-kernels

# The full suite, every marker: what CI runs (.ci/run).
test: setup
	.venv/bin/python -m pytest

# No engine start and nothing slow (markers assigned in tests/conftest.py): under 3 minutes on 2 cores.
test-fast: setup
	.venv/bin/python -m pytest -m "not engine and not slow"

align: setup
	mkdir -p artifacts
	.venv/bin/trace-fp4 align --json artifacts/align.json --plot artifacts/align.png

bench: setup
	.venv/bin/python bench/guidance_size.py
	.venv/bin/python bench/kernels.py
	.venv/bin/python bench/megatron_step.py
	.venv/bin/python bench/vllm_capture.py
	.venv/bin/python bench/kv_capacity.py
	.venv/bin/python bench/sglang_capture.py
	.venv/bin/python bench/record_travel.py
	.venv/bin/python bench/verl_records.py

# The RL miniature is long (about 45 min on 2 cores): run it on its own.
rl-miniature: setup
	.venv/bin/python bench/rl_miniature.py --steps 80 --arms bf16,fp4_qat,trace,trace_default --seeds 0,1,2 \
	  --json bench/results/rl_miniature.json --plot bench/results/rl_miniature.png
