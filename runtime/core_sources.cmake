# The sources of tally_runtime_core, the torch-free part of the runtime: the
# model config and its families (config.json), the LoRA config, loss specs,
# request types, addresses and memory estimates. Paths are relative to the
# source root. One list for both builds that compile them: runtime/
# CMakeLists.txt (the tally_runtime_core library, linked by tally_runtime and
# the torch-free server units) and the fuzzers' standalone clang build
# (tests/fuzz/standalone), which cannot use the main build's targets. They
# call base/'s JSON reader (tally_base; the fuzz build's json_sources).
set(TALLY_RUNTIME_CORE_SOURCES
  runtime/address.cc
  runtime/families/llama.cc
  runtime/families/mistral.cc
  runtime/families/mixtral.cc
  runtime/families/qwen2.cc
  runtime/families/qwen3.cc
  runtime/families/registry.cc
  runtime/llama_config.cc
  runtime/lora_config.cc
  runtime/loss_spec.cc
  runtime/memory_estimate.cc
  runtime/model_family.cc
  runtime/types.cc)
