# The single entry point: `make run` and `make test` are what a fresh machine needs; CI runs
# `make test` through .ci/run. Everything a target needs is installed or built here.

CARGO ?= cargo
DATA_DIR ?= ./ferrite-data
VOLUME ?= demo
VOLUME_SIZE ?= 2G

.PHONY: run test build release fmt lint tidy unit fuzz deps help compare-ceph

help:
	@echo "make run    build (release), start a single-node cluster in $(DATA_DIR), create volume"
	@echo "            '$(VOLUME)', run the five standard workloads over NVMe/TCP, keep serving"
	@echo "make test   the whole test suite (format, lints, tidy, unit, integration, end to end)"
	@echo "make compare-ceph   optional: Ferrite beside Ceph Pacific on this machine (fio, pgbench);"
	@echo "            writes docs/BENCHMARKS.md; root, ~33 GiB free disk, ~20 min (scripts/compare-ceph.sh --help)"

release: deps
	$(CARGO) build --release --locked --bin ferrite

run: release
	DATA_DIR=$(DATA_DIR) VOLUME=$(VOLUME) VOLUME_SIZE=$(VOLUME_SIZE) scripts/run.sh

# System packages the build and tests use (protoc for the etcd client, etcd, fio). Installed only when
# missing, so a developer machine that has them is not touched.
deps:
	@scripts/deps.sh

fmt:
	$(CARGO) fmt --all -- --check

lint:
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

tidy:
	$(CARGO) xtask tidy

# A short run of every fuzz target over the parsers of untrusted bytes (nightly, cargo-fuzz).
FUZZ_SECONDS ?= 20
fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz-smoke.sh

unit:
	scripts/test-summary.sh

# `unit` runs last so that its closing line, "tests: N passed, N failed", ends the output.
test: deps fmt lint tidy fuzz
	@$(MAKE) --no-print-directory unit

# Optional, not part of `make test`: Ferrite and Ceph Pacific (../shared/anchors/ceph) measured one
# after the other on this machine with the same fio jobs and pgbench; the table and chart go into
# docs/BENCHMARKS.md. Knobs (COMPARE_RUNTIME, COMPARE_SIZE_GB, ...): scripts/compare-ceph.sh --help.
compare-ceph: release
	scripts/compare-ceph.sh
