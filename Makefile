# Two commands on a fresh machine with Python 3.10+ and make: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch: a plain `torch` would pull a multi-GB CUDA build. GPU users install their own.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test test-gpu lint bench-tf-env bench-train proto flags ui-assets ui-firefox-check clean

$(BIN)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $@

demo: $(BIN)/.installed
	$(BIN)/python -m mlscale.demo

# The suite in two parts, both always run: on 4 pytest-xdist workers, a module at a time each, the
# slowest first (tests/conftest.py; most tests wait on subprocesses, sockets and sleeps, so 4 pays on
# 2 cores), then the tests marked `alone` (they time something against a budget) one at a time. The 25
# slowest tests of the first part are listed at its end: where the suite's minutes go.
test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 4 --dist loadscope --no-loadscope-reorder --durations=25 -m "not alone"; parallel=$$?; \
	$(BIN)/python -m pytest -q -m alone; alone=$$?; \
	test $$parallel -eq 0 -a $$alone -eq 0

# On a machine with CUDA (torch with CUDA installed in the venv: TORCH_SPEC=torch): what only a GPU shows.
# Skipped, each with its reason, where there is none.
test-gpu: $(BIN)/.installed
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count(), 'device(s)')"
	$(BIN)/python -m pytest -q -rs -s -m gpu tests/gpu

lint: $(BIN)/.installed
	$(BIN)/ruff check .

# The tf.data anchor of `mlscale bench data --suite images`, in an environment of its own (TensorFlow's
# dependencies need not agree with mlscale's): .venv-tf/bin/python, found there by the benchmark.
bench-tf-env:
	test -x .venv-tf/bin/python || $(PYTHON) -m venv .venv-tf
	.venv-tf/bin/python -m pip install --quiet tensorflow-cpu

bench-train: $(BIN)/.installed
	$(BIN)/mlscale bench train --out bench/results/train

# The Open Inference Protocol's gRPC messages, generated from mlscale/serve/proto/inference.proto
# (committed; tests/serve/test_interop.py checks that the module matches a fresh generation).
proto: $(BIN)/.installed
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. mlscale/serve/proto/inference.proto

# mlscale train's flags, generated from the options models in mlscale/config.py (committed; a test checks them)
flags: $(BIN)/.installed
	$(BIN)/python -m mlscale.cli.train

# mlscale ui's charting asset (mlscale/ui/static/echarts.min.js, committed): Apache ECharts from the npm
# registry at the versions web/package-lock.json pins, only the charts the pages use, minified by esbuild.
# Users never run this; run it after changing web/charts.mjs.
ui-assets:
	cd web && npm ci --no-audit --no-fund && npm run build

# The UI's pages in Firefox (Debian's firefox-esr) against a running `mlscale ui`: each view draws and
# logs no error (the suite runs it too, over its own runs: tests/ui/test_browser.py). URL and VIEWS
# (e.g. "/run/ID /registry/NAME") say what to open besides the runs, registry and serving views.
URL ?= http://127.0.0.1:8080
ui-firefox-check:
	cd web && npm ci --no-audit --no-fund && node check-firefox.mjs $(URL) $(VIEWS)

clean:
	rm -rf $(VENV) runs .pytest_cache
