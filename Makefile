# The README's two commands, `make demo` and `make test`, the fast loop
# `make check`, and `make bench`.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)

.PHONY: all deps configure build wheel test check demo bench format clean

all: build

deps:
	bash scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)

# The Python client's wheel alone (`build` makes it too):
# $(BUILD_DIR)/dist/tally_client-<version>-py3-none-any.whl.
wheel: configure
	cmake --build $(BUILD_DIR) --target tally_python_wheel

# Label bench needs the benchmarks, which only `make bench` builds.
test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j$(JOBS) --timeout 900 \
	  -LE '^bench$$'

# The developer's loop: the unit tests (label unit) and one golden per
# parallel dimension (golden-check), under 3 minutes on 2 cores once built.
check: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j$(JOBS) --timeout 900 \
	  -L '^(unit|golden-check)$$'

demo: build
	bash scripts/demo.sh $(BUILD_DIR)

bench: build
	cmake --build $(BUILD_DIR) -j$(JOBS) --target tally_benchmarks
	cd $(BUILD_DIR) && ctest --output-on-failure -L '^bench$$'
	$(BUILD_DIR)/bench/bench_comm
	$(BUILD_DIR)/bench/bench_optim_step
	$(BUILD_DIR)/bench/bench_rpc
	$(BUILD_DIR)/bench/bench_train
	$(BUILD_DIR)/bench/bench_lora
	$(BUILD_DIR)/bench/bench_attention
	$(BUILD_DIR)/bench/bench_sample

format:
	find server runtime kernels client tests bench -name '*.h' -o -name '*.cc' -o -name '*.cu' \
	  | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)
