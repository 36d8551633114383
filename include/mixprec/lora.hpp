#pragma once
/// LoRA: low-rank adapters on a frozen base (apply_lora, LoraOptions, LoraBase), merged into it
/// and out again (merge_lora, unmerge_lora), the base stored in bf16, fp16 or fp8, and PEFT's
/// files: save_lora_adapter, load_lora_adapter, save_merged_safetensors. docs/lora.md.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/lora/lora_linear.hpp>
#include <mixprec/lora/apply_lora.hpp>
#include <mixprec/lora/peft_files.hpp>
