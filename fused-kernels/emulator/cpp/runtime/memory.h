// Device-like buffers: each allocation is mapped between two inaccessible guard pages, its data
// ends (16-byte aligned) just before the upper one, and the bytes around the data inside the
// mapping hold a canary pattern checked after every launch. An access far past either end faults
// at once (fault.cc names the kernel and thread); a write just past the end (into the alignment
// slack) or before the start (within the first page) is found by the canary check.
#pragma once

#include <cstddef>
#include <string>

namespace emu {

void* buffer_alloc(std::size_t bytes);
void buffer_free(void* data);

// Empty if the canaries of the allocation holding `p` are intact (or `p` is in none); else what
// was overwritten.
std::string buffer_check(const void* p);

// For the fault handler, without locking: a description of `address` relative to the
// allocation whose guard pages hold it, or false.
bool buffer_describe_fault(const void* address, char* out, std::size_t cap);

}  // namespace emu
