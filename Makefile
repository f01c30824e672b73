# The two commands of the README. Both build .venv first (scripts/setup_venv.sh, idempotent).
.PHONY: setup test align bench

setup:
	bash scripts/setup_venv.sh

test: setup
	.venv/bin/python -m pytest

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
