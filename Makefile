# Two commands on a fresh machine: `make test` and `make train`.
# The virtualenv is created on first use; torch is pinned to the CPU wheel first so that
# installing the package never pulls a multi-GB CUDA build of torch.
# Two stamps: what a run needs (torch and the package: RUN_STAMP, for train, compare, study,
# bench) and, on top of it, the test and lint tools (STAMP: `.[dev]`), so that a fresh clone's
# first `make train` does not wait for pytest, ruff, HeavyBall or TensorBoard.
PYTHON ?= python3
comma := ,
VENV ?= .venv
PY := $(VENV)/bin/python
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: install lint test test-quick train train-adamw train-soap train-muon bench clean

# torch's 2,300 modules are byte-compiled by compileall on one core while pip installs the
# rest on the other, instead of by pip, alone, after unpacking torch (the same .pyc files;
# compileall's exit status is not read: like pip, it skips the few files it cannot compile).
$(RUN_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-compile "$(TORCH_PIN)"
	purelib=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	$(PY) -m compileall -q "$$purelib/torch" >/dev/null 2>&1 & compiling=$$!; \
	$(PY) -m pip install --quiet -e .; status=$$?; wait $$compiling; exit $$status
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The tests run on one pytest-xdist worker per core, each test file on one worker (its
# module-scoped fixtures, such as a gloo run that several tests check, are made once), the files
# handed out costliest first (conftest.py orders them; xdist would otherwise put the files with
# the most tests first, which leaves the few long trained runs to the end).
# PYTEST_ARGS adds flags: PYTEST_ARGS="-n 0" runs them in this process alone.
PYTEST_PARALLEL ?= -n auto --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow and not distributed" $(PYTEST_ARGS)

train: $(RUN_STAMP)
	$(PY) -m nanoshampoo.train --preset tiny-shampoo

train-adamw: $(RUN_STAMP)
	$(PY) -m nanoshampoo.train --preset tiny-adamw

train-soap: $(RUN_STAMP)
	$(PY) -m nanoshampoo.train --preset tiny-soap

train-muon: $(RUN_STAMP)
	$(PY) -m nanoshampoo.train --preset tiny-muon

bench: $(RUN_STAMP)
	$(PY) bench/shampoo_step.py

clean:
	rm -rf $(VENV) build *.egg-info

# The embedded leaderboard: every optimizer setup's tiny preset over 3 seeds, into runs/compare
# (leaderboard.md, leaderboard.json, loss_vs_step.png, loss_vs_time.png), without final
# checkpoints; every setup but AdamW also at 0.7x AdamW's steps (does it reach AdamW's loss?). Re-running reuses the runs that already ended; more train flags for every run:
# COMPARE_ARGS="--num-iterations 100".
.PHONY: compare
STEP_FRACTIONS ?= 0.7
compare: $(RUN_STAMP)
	$(PY) -m nanoshampoo compare --setups adamw,shampoo,soap,muon,normuon,muon-cwd,soap-muon,schedule-free,lion,kl-shampoo --seeds 3 --baseline adamw --step-fractions $(STEP_FRACTIONS) --out-dir runs/compare -- --save-final-checkpoint false $(COMPARE_ARGS)

# Every setup tuned at the same budget, then compared at its tuned point, in one command:
# 3 learning rates per setup (1 seed each, 300 steps; one Optuna grid study per setup), the best
# at 3 seeds (its trial is seed 0); the speedrun's track-3 rules next to Welch's test;
# tuning.md / tuned-NAME.toml / study.db per setup under runs/tuned/tune/NAME. One thread per
# run, bf16 autocast fixed (not probed) and eager (no compile), so every run is the same
# computation whatever else loads the machine. 50 runs: about 1h50 on 2 idle cores. More
# workers: the same command again, in another terminal (they share the SQLite stores in the out
# dir) or on other machines with TUNE_STORAGE=postgresql://USER@HOST:PORT/DB on every one; each
# worker takes the next trial or seed from the store, so none trains twice.
TUNE_STORAGE ?=
TUNE_SPECS := \
	--tune 'adamw:adamw.lr=0.0013,0.002,0.003' \
	--tune 'shampoo:shampoo.lr=0.002,0.003,0.0045' \
	--tune 'soap:soap.lr=0.0015,0.003,0.006' \
	--tune 'muon:muon.lr=0.013,0.02,0.03' \
	--tune 'normuon:normuon.lr=0.01,0.02,0.04' \
	--tune 'muon-cwd:muon_cwd.lr=0.01,0.02,0.04' \
	--tune 'soap-muon:soap_muon.lr=0.015,0.03,0.06' \
	--tune 'schedule-free:schedule_free.lr=0.0045,0.006,0.009' \
	--tune 'lion:lion.lr=0.001,0.002,0.004' \
	--tune 'kl-shampoo:kl_shampoo.lr=0.0015,0.003,0.006'
.PHONY: compare-tuned
compare-tuned: $(RUN_STAMP)
	$(PY) -m nanoshampoo compare --setups adamw,shampoo,soap,muon,normuon,muon-cwd,soap-muon,schedule-free,lion,kl-shampoo --seeds 3 --baseline adamw --rule track3 --out-dir runs/tuned $(TUNE_SPECS) $(if $(TUNE_STORAGE),--tune-storage $(TUNE_STORAGE)) -- --threads 1 --autocast bf16 --compile false --progress false --save-final-checkpoint false $(COMPARE_ARGS)

# The longer task: 1300 steps (one epoch of the embedded corpus, 2.7 M tokens; about 50 min on
# 2 cores), AdamW and Muon at the learning rates, head lr and cooldown tuned at that length
# (presets long-adamw and long-muon; docs/results/leaderboard.md "A longer task: 1300 steps"),
# Muon at its full schedule and at 0.7x of it, 3 seeds each, into runs/long-tuned.
.PHONY: compare-long
compare-long: $(RUN_STAMP)
	$(PY) -m nanoshampoo compare --setups adamw=long-adamw,muon=long-muon --seeds 3 --baseline adamw --step-fractions $(STEP_FRACTIONS) --out-dir runs/long-tuned -- --save-final-checkpoint false $(COMPARE_ARGS)

# Issue 11's configs of Shampoo at equal quality: each tiny-shampoo variant in
# bench/shampoo_configs/ over 3 seeds against tiny-shampoo itself (final loss, Welch p), into
# runs/shampoo-configs (also there: freq10-amortized; add it to SHAMPOO_CONFIGS). Step
# costs at GPT-small shapes: bench/shampoo_step.py.
# The storage ablations (bf16-roots, bf16-momentum, bf16-except-factors, bf16-factors-floor,
# fp32-floor, bf16-state-floor13, bf16-state-floor17) are there too: docs/results/shampoo-state.md
# "Which bf16 state costs loss?".
SHAMPOO_CONFIGS ?= freq1 freq10 bf16-state bf16-state-floor packed-bf16 warm-qr large-factor fast
.PHONY: shampoo-configs
shampoo-configs: $(RUN_STAMP)
	$(PY) -m nanoshampoo compare --setups $(subst $() ,$(comma),$(foreach c,$(SHAMPOO_CONFIGS),$(c)=bench/shampoo_configs/$(c).toml)),shampoo --baseline shampoo --seeds 3 --out-dir runs/shampoo-configs -- --save-final-checkpoint false $(COMPARE_ARGS)

# The study: does a matrix optimizer train faster than a tuned AdamW, and does the gain hold as
# the model and the budget grow? `nanoshampoo study --study cpu` (nanoshampoo/evidence/studies/
# cpu.toml): AdamW, Muon, Shampoo and SOAP at two sizes, each tuned over lr x weight decay at
# each size, then 3 seeds at its best point, four budgets from every run (decay branches). Two
# workers of one study (one thread each) share its trial store; the second's output goes to
# $(STUDY_DIR)/worker-2.out. Writes study.md, study.json and the plots into $(STUDY_DIR) and
# copies them to docs/results/study/ (the README shows its table and speedup plot).
# Re-running trains nothing.
STUDY_DIR ?= runs/study
.PHONY: study
study: $(RUN_STAMP)
	mkdir -p $(STUDY_DIR)
	$(PY) -m nanoshampoo study --study cpu --out-dir $(STUDY_DIR) > $(STUDY_DIR)/worker-2.out 2>&1 & \
	worker=$$!; $(PY) -m nanoshampoo study --study cpu --out-dir $(STUDY_DIR); status=$$?; \
	wait $$worker || status=1; exit $$status
	mkdir -p docs/results/study
	cp $(STUDY_DIR)/study.md $(STUDY_DIR)/study.json $(STUDY_DIR)/*.png docs/results/study/
