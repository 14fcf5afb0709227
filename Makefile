# Thin wrappers; every target runs with the interpreter utils/env.sh picks (and sets up if needed).
PY := $(shell sh utils/env.sh)
ifeq ($(strip $(PY)),)
$(error utils/env.sh found or set up no Python interpreter (its messages are above); nothing was run)
endif

.PHONY: run test build profile sanitize notebook student grade clean

run:        ## on a GPU: build, run every lesson, redraw every table and plot; without one: only redraw them
	$(PY) -m utils.run_all

test:       ## the whole test suite: CPU tests, every extension compiled, GPU tests where a GPU is
	$(PY) -m pytest -q

build:      ## build every extension in parallel, showing each build as it starts and finishes (with its time)
	$(PY) -m utils.build --all

sanitize:   ## compute-sanitizer memcheck and racecheck over every lesson's kernels (GPU)
	$(PY) -m utils.sanitize

profile:    ## the phase 1 profile of the PyTorch baseline (GPU)
	$(PY) -m phase1_baseline.run

notebook:   ## open the walkthrough notebook in JupyterLab (installs the optional extra `notebook` the first time)
	@$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install -e '.[notebook]'
	$(PY) -m jupyter lab final/walkthrough.ipynb

student:    ## write the student starter kit: make student OUT=DIR
	@test -n "$(OUT)" || { echo "usage: make student OUT=DIR (the folder the starter kit is written to)"; exit 2; }
	$(PY) -m utils.student --out $(OUT)

grade:      ## grade one phase (PHASE=N) or all; HIDDEN=DIR adds hidden tests; RESUME=1 goes on after a stop; OFFICIAL=1 runs only the tests that earn points; report in build/grade/
	$(PY) -m utils.grade $(if $(PHASE),--phase $(PHASE),--all) $(if $(HIDDEN),--hidden-tests $(HIDDEN)) $(if $(RESUME),--resume) $(if $(OFFICIAL),--official-only)

clean:      ## remove build outputs (not results)
	rm -rf build .pytest_cache
