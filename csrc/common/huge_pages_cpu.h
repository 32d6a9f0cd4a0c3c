// Large CPU arrays read at random (slot arrays, embedding rows): backed by
// 2 MiB pages where the kernel offers them on request (transparent huge
// pages in "madvise" mode). With 4 KiB pages every random row read of a
// table larger than the TLB's reach costs a page walk, and under a
// hypervisor a two-level one; measured on this project's 2-core VM, 2 MiB
// pages cut the embedding forward and backward by about a third.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstddef>

namespace dynamicemb {
namespace cpu {

// Asks for 2 MiB pages over the whole 2 MiB-aligned part of [p, p + bytes).
// Call it before the pages are first touched (pages already there stay
// small). A hint: returns whether the kernel took it.
bool advise_huge_pages(void* p, size_t bytes);

// An uninitialised CPU tensor; from 4 MiB on, in a fresh 2 MiB-aligned
// mapping of its own with that advice taken (its pages untouched), freed
// with the tensor. Its storage cannot be resized.
at::Tensor empty_huge(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace cpu
}  // namespace dynamicemb
