# zrun: `make demo` trains the tiny GPT; `make test` runs every check CI runs.
SHELL := /bin/bash
ENV := source scripts/env.sh &&
CARGO_FLAGS := --release --workspace

.PHONY: setup build demo test fmt clippy clean
setup:
	@scripts/setup.sh

build: setup
	$(ENV) cargo build --release -p zrun

demo: build
	$(ENV) ./target/release/zrun --nproc 2 configs/tiny-cpu.toml

fmt:
	$(ENV) cargo fmt --all

clippy: setup
	$(ENV) cargo clippy $(CARGO_FLAGS) --all-targets -- -D warnings
	$(ENV) cargo clippy $(CARGO_FLAGS) --features zrun/cuda --all-targets -- -D warnings

test: setup
	$(ENV) cargo fmt --all -- --check
	$(ENV) cargo clippy $(CARGO_FLAGS) --all-targets -- -D warnings
# The CUDA build (NCCL backend, libtorch's CUDA part) is checked too, though no GPU is here.
	$(ENV) cargo clippy $(CARGO_FLAGS) --features zrun/cuda --all-targets -- -D warnings
	$(ENV) scripts/test.sh
	$(ENV) cargo test --release -p zrun-torch-ext --features cuda --lib
	$(ENV) cargo clippy --release -p zrun-comm --features mpi,cuda --all-targets -- -D warnings
	$(ENV) cargo test --release -p zrun-comm --features mpi,cuda --lib --test mpi
	$(ENV) cargo test --release -p zrun --features mpi --test launcher --test examples mpirun

clean:
	cargo clean
