#pragma once
/// Moved: this header is <mixprec/core/concepts.hpp>
/// since include/mixprec has a folder per subsystem; the old path forwards to it for one minor
/// release (removed in mixprec 0.3: docs/api.md, "Moved headers").
/// MIXPREC_NO_MOVED_HEADER_MESSAGE silences the note.

#ifndef MIXPREC_NO_MOVED_HEADER_MESSAGE
#pragma message("mixprec: <mixprec/concepts.hpp> is now "  \
                "<mixprec/core/concepts.hpp>; include that "  \
                "(the old path goes in mixprec 0.3)")
#endif

#include <mixprec/core/concepts.hpp>
