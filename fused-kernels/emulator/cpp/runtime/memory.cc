// Guarded buffers (see memory.h).
#include "memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

namespace emu {

namespace {

struct Allocation {
  char* map;
  std::size_t map_len;
  std::size_t page;
  char* data;
  std::size_t bytes;
};

std::mutex g_mutex;
std::map<std::uintptr_t, Allocation> g_allocations;  // by the mapping's start

unsigned char canary(std::size_t offset) { return static_cast<unsigned char>(0xA5u ^ (offset * 29u)); }

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// The allocation whose mapping (guard pages included) holds `p`; the caller holds g_mutex.
const Allocation* find(std::uintptr_t p) {
  auto it = g_allocations.upper_bound(p);
  if (it == g_allocations.begin()) return nullptr;
  --it;
  const Allocation& a = it->second;
  return p < reinterpret_cast<std::uintptr_t>(a.map) + a.map_len ? &a : nullptr;
}

}  // namespace

void* buffer_alloc(std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t span = round_up(bytes, 16);
  const std::size_t pages = span == 0 ? page : round_up(span, page);
  const std::size_t map_len = pages + 2 * page;
  void* m = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  char* map = static_cast<char*>(m);
  mprotect(map, page, PROT_NONE);
  mprotect(map + page + pages, page, PROT_NONE);
  char* data = map + page + pages - span;
  for (char* c = map + page; c < data; ++c) *c = static_cast<char>(canary(static_cast<std::size_t>(c - map)));
  std::memset(data, 0xFF, bytes);
  for (char* c = data + bytes; c < map + page + pages; ++c) *c = static_cast<char>(canary(static_cast<std::size_t>(c - map)));
  std::lock_guard<std::mutex> lock(g_mutex);
  g_allocations[reinterpret_cast<std::uintptr_t>(map)] = Allocation{map, map_len, page, data, bytes};
  return data;
}

void buffer_free(void* data) {
  if (!data) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  const Allocation* a = find(reinterpret_cast<std::uintptr_t>(data));
  if (!a) return;
  Allocation copy = *a;
  g_allocations.erase(reinterpret_cast<std::uintptr_t>(copy.map));
  munmap(copy.map, copy.map_len);
}

std::string buffer_check(const void* p) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const Allocation* a = find(reinterpret_cast<std::uintptr_t>(p));
  if (!a) return std::string();
  const char* lo = a->map + a->page;
  const char* hi = a->data + a->bytes;
  const char* end = hi + (round_up(a->bytes, 16) - a->bytes);
  std::size_t before = 0, after = 0;
  for (const char* c = lo; c < a->data; ++c) before += static_cast<unsigned char>(*c) != canary(static_cast<std::size_t>(c - a->map));
  for (const char* c = hi; c < end; ++c) after += static_cast<unsigned char>(*c) != canary(static_cast<std::size_t>(c - a->map));
  if (before == 0 && after == 0) return std::string();
  char msg[256];
  std::snprintf(msg, sizeof msg,
                "the kernel wrote outside its %zu-byte buffer: %zu byte(s) changed in the %zu bytes before its start, "
                "%zu in the %zu bytes after its end",
                a->bytes, before, static_cast<std::size_t>(a->data - lo), after, static_cast<std::size_t>(end - hi));
  return msg;
}

bool buffer_describe_fault(const void* address, char* out, std::size_t cap) {
  if (!g_mutex.try_lock()) return false;
  const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(address);
  const Allocation* a = find(p);
  bool found = false;
  if (a) {
    const std::uintptr_t data = reinterpret_cast<std::uintptr_t>(a->data);
    if (p >= data + a->bytes) {
      std::snprintf(out, cap, "%zu bytes past the end of a %zu-byte buffer", static_cast<std::size_t>(p - data - a->bytes),
                    a->bytes);
    } else {
      std::snprintf(out, cap, "%zu bytes before the start of a %zu-byte buffer", static_cast<std::size_t>(data - p),
                    a->bytes);
    }
    found = true;
  }
  g_mutex.unlock();
  return found;
}

}  // namespace emu
