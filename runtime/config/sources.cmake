# The sources of tally_config, the torch-free room of the runtime: the model
# config and its families (config.json), the LoRA and PEFT adapter configs,
# loss specs, request types, addresses and memory estimates. Paths are
# relative to the source root. One list for the three builds that compile
# them: runtime/config/CMakeLists.txt (the tally_config library, linked by the
# other rooms and the torch-free server units), the sanitized twin of the
# server units (tests/server_units) and the fuzzers' standalone clang build
# (tests/fuzz/standalone), which cannot use the main build's targets. They
# call base/'s JSON reader (tally_base; the fuzz build's json_sources).
set(TALLY_CONFIG_SOURCES
  runtime/config/address.cc
  runtime/config/families/llama.cc
  runtime/config/families/mistral.cc
  runtime/config/families/mixtral.cc
  runtime/config/families/qwen2.cc
  runtime/config/families/qwen3.cc
  runtime/config/families/registry.cc
  runtime/config/generation_config.cc
  runtime/config/llama_config.cc
  runtime/config/lora_config.cc
  runtime/config/loss_spec.cc
  runtime/config/memory_estimate.cc
  runtime/config/model_family.cc
  runtime/config/peft_adapter_config.cc
  runtime/config/sampler_name.cc
  runtime/config/sampling_params.cc
  runtime/config/types.cc)
