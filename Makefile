# Two set-up commands for a fresh machine: `make demo` and `make test`.
# Each creates .venv when missing and installs ckptfix into it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch/torchvision builds this project is tested with; override e.g. TORCH_SPEC="torch torchvision".
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
# deepspeed for tests/formats/test_deepspeed.py's real ZeRO runs (they skip without it); DEEPSPEED_SPEC= skips it.
DEEPSPEED_SPEC ?= deepspeed==0.19.8
# A second torch release the frozen tables are checked against (tests/core/test_torch_tables.py, in its own
# venv: torch and pytest only); OTHER_TORCH= skips it.
OTHER_TORCH ?= torch==2.13.0
OTHER_VENV ?= .venv-other-torch
DEMO_DIR ?= demo-out
# The suite on every core (pytest-xdist), a test module's tests on one worker (its module fixtures made once);
# PYTEST_ARGS= runs it in one process.
PYTEST_ARGS ?= -n auto --dist loadfile

.PHONY: demo test test-other-torch install clean

$(VENV)/.installed: pyproject.toml setup.py ckptfix/core/_scan.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH_SPEC)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
# Optional: deepspeed's sdist is built against the torch installed above (no build isolation, no C++ ops:
# its JIT ops build on first use where needed). A failure is reported and skipped, never fatal.
	@test -z "$(DEEPSPEED_SPEC)" || DS_BUILD_OPS=0 $(PY) -m pip install --quiet --disable-pip-version-check \
	  --no-build-isolation $(DEEPSPEED_SPEC) || echo "note: $(DEEPSPEED_SPEC) did not install (see above);" \
	  "tests/formats/test_deepspeed.py will skip its real-DeepSpeed tests"
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed $(if $(OTHER_TORCH),$(OTHER_VENV)/.installed)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest $(PYTEST_ARGS)
	@$(if $(OTHER_TORCH),$(OTHER_TABLES),true)

# An install failure (no such wheel for this machine) is reported and skipped; a failing table is fatal.
$(OTHER_VENV)/.installed: pyproject.toml
	@echo "== the frozen torch tables against $(OTHER_TORCH), in $(OTHER_VENV)"
	mkdir -p $(OTHER_VENV) && rm -f $(OTHER_VENV)/.skipped
	{ test -x $(OTHER_VENV)/bin/python || $(PYTHON) -m venv $(OTHER_VENV); } \
	  && $(OTHER_VENV)/bin/pip install --quiet --disable-pip-version-check $(OTHER_TORCH) pytest \
	  && $(OTHER_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e . \
	  || echo "$(OTHER_TORCH) did not install (see above)" > $(OTHER_VENV)/.skipped
	touch $@

# The table tests in the second venv (a note instead where its torch did not install).
define OTHER_TABLES
if [ -f $(OTHER_VENV)/.skipped ]; then \
  echo "note: $$(cat $(OTHER_VENV)/.skipped); the tables were checked against $(TORCH_SPEC) only"; \
else $(OTHER_VENV)/bin/python -m pytest -q -p no:cacheprovider --noconftest tests/core/test_torch_tables.py; fi
endef

test-other-torch: $(OTHER_VENV)/.installed
	@$(OTHER_TABLES)

demo: $(VENV)/.installed
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	@echo "== train the MLP with real DistributedDataParallel (2 processes, gloo) and save it"
	$(PY) fixtures/train.py --out $(DEMO_DIR) --model mlp --modes ddp
	@echo "== plain torch.load + load_state_dict fails on it:"
	-$(PY) -c "import sys, torch; sys.path.insert(0, 'fixtures'); from train import mlp; \
	  mlp().load_state_dict(torch.load('$(DEMO_DIR)/mlp_ddp.pth', weights_only=True))" 2>&1 | tail -n 2
	@echo "== inspect, convert to the single form, inspect the result"
	$(VENV)/bin/ckptfix inspect $(DEMO_DIR)/mlp_ddp.pth
	$(VENV)/bin/ckptfix convert $(DEMO_DIR)/mlp_ddp.pth $(DEMO_DIR)/mlp.safetensors
	$(VENV)/bin/ckptfix inspect $(DEMO_DIR)/mlp.safetensors
	@echo "== the pre-deploy gate: keys, shapes, dtypes and the forward output against the original"
	$(VENV)/bin/ckptfix verify $(DEMO_DIR)/mlp.safetensors --model fixtures/train.py:mlp --reference $(DEMO_DIR)/mlp_ddp.pth
	@echo "== load it into a fresh model and check it reproduces the trained model's output"
# Bit-exact (==) is right here: this demo run wrote that manifest, on this machine. An output recorded
# elsewhere (fixtures/manifest.json) needs the recorded-value tolerance (docs/verify.md: Tolerance).
	$(PY) -c "import sys, json, torch, ckptfix; sys.path.insert(0, 'fixtures'); from train import mlp, fixed_input; \
	  m = mlp(); print(ckptfix.load_into(m, '$(DEMO_DIR)/mlp.safetensors')); m.eval(); \
	  want = json.load(open('$(DEMO_DIR)/manifest.json'))['fixtures']['mlp_ddp.pth']['output']; \
	  got = m(fixed_input('mlp')).tolist(); print('output matches the trained model:', got == want); assert got == want"

clean:
	rm -rf $(VENV) $(OTHER_VENV) $(DEMO_DIR) .pytest_cache .mypy_cache .ruff_cache *.egg-info
