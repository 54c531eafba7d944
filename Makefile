# The two commands of the README: `make demo` (main job) and `make test` (whole test suite).
# Each does the setup it needs; setup is idempotent and fast once done.
CARGO ?= cargo

.PHONY: demo test setup data doc lint check-shim public-api bench clean

setup:
	@bash scripts/setup-libtorch.sh

data:
	@bash scripts/setup-data.sh

demo: setup data
	$(CARGO) run --release --example fashion_mnist -- $(ARGS)

test: setup data
	$(CARGO) test $(TESTFLAGS)

doc: setup
	$(CARGO) doc --no-deps

lint: setup
	python3 scripts/check-module-dag.py
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --all-targets --features cuda-tests -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps
	python3 scripts/public-api.py --check .ci/public-api.txt

# Regenerates the checked public-API listing after an intended change of the public API.
public-api: setup
	$(CARGO) doc --no-deps
	python3 scripts/public-api.py > .ci/public-api.txt

# The distributed shim against the other supported torch's headers (scripts/check-shim-headers.sh).
check-shim:
	@bash scripts/check-shim-headers.sh 2.11.0

bench: setup
	$(CARGO) bench --bench amp

clean:
	$(CARGO) clean
