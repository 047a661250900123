# Two entry points: `make demo` and `make test`. Both set up .venv (idempotent) and install what they need.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.qasr-installed
KERNELS := $(VENV)/.qasr-kernels-built
TORCH_CPU := torch==2.13.0

.PHONY: demo test test-slow test-ray lint bench setup clean

setup: $(STAMP) $(KERNELS)

$(STAMP): pyproject.toml
	@# espeak-ng and ffmpeg make test speech; chromium (+ its driver) runs the web page in the server tests
	@command -v espeak-ng >/dev/null 2>&1 && command -v ffmpeg >/dev/null 2>&1 && \
	  command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
	  echo "installing Debian packages espeak-ng, ffmpeg, chromium and chromium-driver"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && \
	  $$SUDO apt-get install -y -qq espeak-ng ffmpeg chromium chromium-driver >/dev/null; }
	@test -x $(PY) || python3 -m venv $(VENV)
	@# CPU machines get the local CPU wheel of torch first; a GPU machine keeps the CUDA torch it has.
	@$(PY) -c "import torch" 2>/dev/null || { \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	  else $(PY) -m pip install -q $(TORCH_CPU); fi; }
	$(PY) -m pip install -q -e ".[test]"
	@# the VAD model files; --no-deps: its torchaudio requirement would replace the torch installed above
	$(PY) -m pip install -q --no-deps "silero-vad>=6"
	@touch $(STAMP)

# qasr's C++ CPU kernels for this machine now, several at once, so the first transcription need not compile
# (docs/kernels.md); again when a kernel's source changes. A kernel this CPU cannot run is reported; one that
# fails to build or self-test stops make (qasr kernels build exits 1).
$(KERNELS): $(STAMP) $(wildcard src/qasr/engine/cpu/csrc/*.cpp src/qasr/engine/cpu/csrc/*.h) src/qasr/engine/cpu/native.py src/qasr/engine/cpu/build.py
	$(VENV)/bin/qasr kernels build
	@touch $(KERNELS)

demo: $(STAMP) $(KERNELS)
	$(PY) examples/demo.py

test: $(STAMP) $(KERNELS)
	$(PY) -m pytest -q

# the whole-product runs marked `slow` (left out of `make test`, which stays under 8 minutes on 2 cores)
test-slow: $(STAMP) $(KERNELS)
	$(PY) -m pytest -q -m slow

# the Ray tests (pytest marker `ray`, left out of `make test`): the ray extra first, keeping the torch installed
RAY_STAMP := $(VENV)/.qasr-ray-installed
$(RAY_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[ray]"
	@$(PY) -c "import torch, ray; print('ray', ray.__version__, 'with torch', torch.__version__)"
	@touch $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	$(PY) -m pytest -q -m ray tests/distributed/test_ray_data.py tests/distributed/test_ray_serve.py

# ruff, and no lab-notebook line (dates, machine names, work stories) in the comments of src/ (docs/contributing.md)
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts examples
	$(PY) scripts/house_figures.py --check

bench: $(STAMP)
	$(PY) benchmarks/throughput.py --quick

clean:
	rm -rf $(VENV) build dist src/*.egg-info
