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

// An uninitialised CPU tensor; from 4 MiB on, the 2 MiB-aligned part of its
// block asked to be backed by 2 MiB pages (pages already there stay small:
// the heap may hand back a block already faulted in, which saves a kernel
// that keeps scratch from call to call its page faults).
at::Tensor empty_huge(at::IntArrayRef sizes, at::ScalarType dtype);

// The same in a fresh 2 MiB-aligned mapping of its own (freed with the
// tensor; its storage cannot be resized), advised before its first touch,
// so that 2 MiB pages can back all of it: served tables (read at random,
// never resized) looked up 18-32% faster than in empty_huge's blocks, which
// leave partial 2 MiB ranges at both ends on small pages. Training tables
// measured no gain from it (their arrays are large: the ends are a small share).
at::Tensor empty_mapped(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace cpu
}  // namespace dynamicemb
