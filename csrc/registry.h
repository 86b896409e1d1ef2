// Registration hooks: one function per kernel family, defined next to its bindings.
#pragma once
#include <pybind11/pybind11.h>

namespace ddtree {
void register_runtime(pybind11::module_& m);
void register_tree(pybind11::module_& m);  // csrc/tree/tree_bindings.cpp
void register_transport(pybind11::module_& m);  // csrc/transport_ops.cpp
void register_moe(pybind11::module_& m);  // csrc/moe/moe_bindings.cpp
}  // namespace ddtree
