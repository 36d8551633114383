#pragma once
/// Files in and out: weights from Python's torch.save and safetensors files into a model by name
/// (load_weights, load_state_dict, read_torch_save, read_safetensors), weights out to Python
/// (save_safetensors), and the atomic, checksummed files of Trainer checkpoints. Trainer::load_weights (trainer.hpp) loads into a trained model.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/io/state_dict.hpp>
#include <mixprec/io/safetensors.hpp>
#include <mixprec/io/save_safetensors.hpp>
#include <mixprec/io/torch_save.hpp>
#include <mixprec/io/load_state_dict.hpp>
#include <mixprec/io/atomic_file.hpp>
#include <mixprec/io/checkpoint_file.hpp>
