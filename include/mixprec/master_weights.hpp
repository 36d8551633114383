#pragma once
/// Moved: this header is <mixprec/optim/master_weights.hpp>
/// since include/mixprec has a folder per subsystem; the old path forwards to it for one minor
/// release (removed in mixprec 0.3: docs/api.md, "Moved headers").
/// MIXPREC_NO_MOVED_HEADER_MESSAGE silences the note.

#ifndef MIXPREC_NO_MOVED_HEADER_MESSAGE
#pragma message("mixprec: <mixprec/master_weights.hpp> is now "  \
                "<mixprec/optim/master_weights.hpp>; include that "  \
                "(the old path goes in mixprec 0.3)")
#endif

#include <mixprec/optim/master_weights.hpp>
