# minillm: `make serve` and `make test` are the two commands of the quickstart; each sets up
# .venv (CPU build of torch on machines without an NVIDIA GPU) on first use.
PY      := .venv/bin/python
VENV    := .venv/.minillm-installed
CH      ?= 1
HOST    ?= 127.0.0.1
PORT    ?= 8000
# mkdocs 1.x prints a notice about 2.0 on every run.
export NO_MKDOCS_2_WARNING := 1

.PHONY: help serve site test book docs grade gpu notebooks clean

help:
	@echo "make serve       the OpenAI-compatible server with the bundled model at http://$(HOST):$(PORT)/v1"
	@echo "make site        open the book: serve the docs site at http://$(HOST):$(PORT)/"
	@echo "make test        the full CPU test suite (what CI runs)"
	@echo "make book        Jupyter Lab on chapters/"
	@echo "make docs        build the docs site into site/ (strict)"
	@echo "make grade CH=N  grade your exercises of chapter N"
	@echo "make gpu         GPU tests and benchmarks (CUDA machine); results in bench/results/"
	@echo "make notebooks   re-execute every chapter notebook in place (maintainers)"

$(VENV): pyproject.toml scripts/setup-venv.sh
	bash scripts/setup-venv.sh

# The bundled model on the GPU if there is one, else on the CPU; MODEL=PATH serves another.
MODEL   ?= minillm/checkpoints/shakespeare
serve: $(VENV)
	$(PY) -m minillm.cli serve --model $(MODEL) --host $(HOST) --port $(PORT)

site: $(VENV)
	@echo "minillm: serving the book at http://$(HOST):$(PORT)/ (Ctrl-C to stop)"
	.venv/bin/mkdocs serve -a $(HOST):$(PORT)

# One pytest worker per core (pytest-xdist): the interpreter-run kernel tests and the
# notebooks are CPU bound. PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= auto
test: $(VENV)
	$(PY) -m pytest -n $(PYTEST_WORKERS)

book: $(VENV)
	.venv/bin/jupyter lab chapters/

docs: $(VENV)
	.venv/bin/mkdocs build --strict

grade: $(VENV)
	$(PY) -m minillm.grade $(CH) $(if $(HINT),--hint $(HINT))

# On a GPU machine whose python3 already has torch+triton (e.g. the project's device), no
# venv is needed: scripts/gpu.sh uses $PYTHON, defaulting to .venv's python if present.
gpu:
	PYTHON=$${PYTHON:-$$([ -x $(PY) ] && echo $(PY) || echo python3)} bash scripts/gpu.sh

notebooks: $(VENV)
	for nb in chapters/*.ipynb; do .venv/bin/jupyter nbconvert --to notebook --execute --inplace "$$nb" || exit 1; done

clean:
	rm -rf site build .pytest_cache
