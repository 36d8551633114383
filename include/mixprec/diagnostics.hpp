#pragma once
/// Diagnostics: where an inf/NaN came from (Overflow, NonFiniteOpFinder), the gradients'
/// ranges per layer (GradientStats), and advise(), which records a few steps and recommends a
/// policy and a precision map. docs/diagnostics.md shows them on the demo.
///
///   mixprec::TrainerOptions options;
///   options.find_non_finite_op(true)                                  // debugging: slow
///       .gradient_stats(mixprec::GradientStatsOptions().every(100).group_depth(1));
///   options.on_step([](const mixprec::StepReport& r) {
///     if (r.overflow) std::cerr << "step " << r.step << " skipped: " << *r.overflow << '\n';
///     if (r.non_finite_op) std::cerr << "  first inf/NaN: " << *r.non_finite_op << '\n';
///     if (r.gradient_stats) std::cerr << *r.gradient_stats;
///   });
///   ...
///   { mixprec::NamedScope scope("encoder"); h = encoder->forward(x); }  // names the op's scope

#include <ATen/ATen.h>  // first: its header check precompiles it (tests/CMakeLists.txt)
#include <mixprec/diagnostics/overflow.hpp>
#include <mixprec/diagnostics/gradient_stats.hpp>
#include <mixprec/diagnostics/op_observer.hpp>
#include <mixprec/diagnostics/non_finite_op.hpp>
#include <mixprec/diagnostics/advice.hpp>
#include <mixprec/diagnostics/advise.hpp>
