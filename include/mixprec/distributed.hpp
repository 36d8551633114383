#pragma once
/// Data parallel across processes on c10d (Gloo on the CPU, NCCL on CUDA): DistributedOptions,
/// DataParallel (bucketed gradient averaging, sharded optimizer state) and the process groups
/// a launcher's environment describes; ShardedBuild, a model built unit by unit into shards.
/// Brings c10d's headers; trainer.hpp does not.

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/distributed/data_parallel.hpp>
#include <mixprec/distributed/process_group.hpp>
