#pragma once
// The fuzz targets' bodies (harness.cpp); declared without LibTorch so that each entry point
// compiles in a moment.
#include <cstddef>
#include <cstdint>

void fuzz_trainer_load_init();
int fuzz_trainer_load(const std::uint8_t* data, std::size_t size);
void fuzz_scaler_load_init();
int fuzz_scaler_load(const std::uint8_t* data, std::size_t size);
void fuzz_ops_mask_init();
int fuzz_ops_mask(const std::uint8_t* data, std::size_t size);
void fuzz_safetensors_init();
int fuzz_safetensors(const std::uint8_t* data, std::size_t size);
void fuzz_torch_save_init();
int fuzz_torch_save(const std::uint8_t* data, std::size_t size);
