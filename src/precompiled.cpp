// mixprec's compiled companion (CMake target mixprec::precompiled, docs/build.md): the Trainer
// of every policy of MIXPREC_PRECOMPILED_POLICIES (trainer/precompiled.hpp), which the TUs that
// link the companion then do not compile. One translation unit for all of them: what a Trainer
// compiles is mostly code that no policy changes (LibTorch's inline functions, the step's
// policy-free stages), which one TU compiles once; each policy adds about 3 % to it (docs/build.md).
#include <mixprec/trainer.hpp>

#define MIXPREC_DEFINE_TRAINER(...) MIXPREC_TRAINER_INSTANCE(, __VA_ARGS__)
MIXPREC_PRECOMPILED_POLICIES(MIXPREC_DEFINE_TRAINER)
#undef MIXPREC_DEFINE_TRAINER
