// A caching allocator for libtorch's CPU device, installed with c10::SetCPUAllocator.
//
// Rule (documented in src/cpu_alloc.rs too):
// - a request of 0 bytes gets a null pointer, as c10's default allocator gives;
// - a request below SMALL (64 KiB) is a 64-byte aligned block from the C heap
//   (posix_memalign): glibc's heap already keeps and reuses small blocks, so they are not
//   cached here, only counted (allocated and reserved while live);
// - a larger request is rounded up to whole pages (4 KiB) and carved out of an arena: one
//   large range of address space reserved at the first request (PROT_NONE, so it costs
//   nothing until used) and made writable as it grows. A request takes, in this order:
//   1. the smallest free block that holds it whose pages are still resident (best fit; the
//      rest of the block stays free), so nothing is faulted in;
//   2. a free block at the arena's end extended by what it lacks;
//   3. the smallest free block whose pages were returned to the system;
//   4. fresh pages at the arena's end (a new arena when it is full).
//   A freed block merges with free neighbours, so blocks freed in any order become one
//   block again and a request of another size reuses them: what the arena holds at its
//   peak stays close to the most bytes live at once, the figure an estimate of the tensors
//   predicts. Freed blocks keep their pages (no unmap, no fault on reuse) until
//   `empty_cache` or the limit returns them (madvise(MADV_DONTNEED)).
// - with a limit, a request that needs fresh pages past it first returns every cached page
//   to the system, then, if still over, fails with c10::OutOfMemoryError naming the bytes
//   requested ("tried to allocate N bytes"), which callers can catch.
//
// Every block's DataPtr carries this allocator's deleter, and blocks made before it was
// installed carry the default allocator's: each is freed by the allocator that made it.
// The allocator is never destroyed (tensors may be freed during process exit).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr size_t SMALL = 64 << 10;
constexpr size_t PAGE = 4 << 10;
constexpr size_t HUGE_PAGE = 2 << 20;
// Address space reserved per arena (halved down to the request where the system refuses).
constexpr size_t ARENA_BYTES = size_t{1} << 40;
// An arena is made writable in steps of this much (only touched pages cost memory).
constexpr size_t COMMIT_STEP = 64 << 20;
constexpr size_t ALIGN = 64;  // c10::gAlignment on x86-64
// c10's default allocator registers with priority 0; this one replaces it.
constexpr uint8_t PRIORITY = 100;

std::string mib(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

void delete_block(void* ptr);

class CachingCpuAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return {nullptr, nullptr, &delete_block, c10::Device(c10::DeviceType::CPU)};
    }
    void* ptr = nullptr;
    size_t allocated = 0;
    size_t reserved = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      bool small = n < SMALL;
      size_t size = small ? n : round_up(n, PAGE);
      int arena = -1;
      if (small) {
        ptr = take_small(n);
      } else {
        ptr = take_large(n, size, &arena);
      }
      live_.emplace(ptr, Live{size, small, arena});
      allocated_ += size;
      peak_allocated_ = std::max(peak_allocated_, allocated_);
      peak_reserved_ = std::max(peak_reserved_, reserved_);
      allocated = allocated_;
      reserved = reserved_;
    }
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(ptr, static_cast<int64_t>(n), allocated, reserved,
                                       c10::Device(c10::DeviceType::CPU));
    }
    return {ptr, ptr, &delete_block, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  void free(void* ptr) {
    if (ptr == nullptr) {
      return;
    }
    size_t size = 0;
    size_t allocated = 0;
    size_t reserved = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(ptr);
      if (it == live_.end()) {
        // Not ours: cannot happen, as each DataPtr names the allocator that made it.
        return;
      }
      Live live = it->second;
      size = live.size;
      live_.erase(it);
      allocated_ -= size;
      if (live.small) {
        std::free(ptr);
        reserved_ -= size;
      } else {
        add_free(static_cast<char*>(ptr), size, false, live.arena);
      }
      allocated = allocated_;
      reserved = reserved_;
    }
    if (c10::memoryProfilingEnabled()) {
      c10::reportMemoryUsageToProfiler(ptr, -static_cast<int64_t>(size), allocated, reserved,
                                       c10::Device(c10::DeviceType::CPU));
    }
  }

  void set_limit(size_t limit) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = limit;
  }

  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    release_cached();
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    peak_allocated_ = allocated_;
    peak_reserved_ = reserved_;
  }

  void stats(int64_t* out) {
    std::lock_guard<std::mutex> lock(mu_);
    out[0] = static_cast<int64_t>(allocated_);
    out[1] = static_cast<int64_t>(reserved_);
    out[2] = static_cast<int64_t>(peak_allocated_);
    out[3] = static_cast<int64_t>(peak_reserved_);
    out[4] = static_cast<int64_t>(fresh_);
    out[5] = static_cast<int64_t>(returned_);
    out[6] = static_cast<int64_t>(limit_);
  }

 private:
  struct Live {
    size_t size;
    bool small;
    int arena;  // -1 for small blocks
  };
  struct Free {
    size_t size;
    bool returned;  // its pages went back to the system
    int arena;
  };
  struct Arena {
    char* base;
    size_t cap;        // bytes of address space
    size_t top;        // [base, base + top) has been handed out
    size_t writable;   // [base, base + writable) is PROT_READ | PROT_WRITE
  };
  using BySize = std::set<std::pair<size_t, char*>>;

  // Under mu_.
  void* take_small(size_t n) {
    void* ptr = nullptr;
    if (limit_ != 0 && reserved_ + n > limit_) {
      release_cached();
      if (reserved_ + n > limit_) {
        over_limit(n);
      }
    }
    if (posix_memalign(&ptr, ALIGN, n) != 0 || ptr == nullptr) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: tried to allocate ", n,
                       " bytes (", mib(n), "): the C heap refused");
    }
    reserved_ += n;
    return ptr;
  }

  // Under mu_: `size` (a multiple of PAGE) for a request of `n` bytes, by the order at the
  // top of this file.
  char* take_large(size_t n, size_t size, int* arena) {
    auto hit = resident_.lower_bound({size, nullptr});
    if (hit != resident_.end()) {
      return split(hit->second, size, arena);
    }
    for (int attempt = 0; attempt < 2; ++attempt) {
      char* ptr = take_fresh(size, arena);
      if (ptr != nullptr) {
        return ptr;
      }
      release_cached();
    }
    over_limit(n);
    return nullptr;
  }

  // Under mu_: a block that needs pages from the system, or null when that would pass the
  // limit.
  char* take_fresh(size_t size, int* arena) {
    // A free block at an arena's end, extended by what it lacks.
    for (size_t a = 0; a < arenas_.size(); ++a) {
      Arena& ar = arenas_[a];
      auto last = free_.lower_bound(ar.base + ar.top);
      if (last == free_.begin()) {
        continue;
      }
      --last;
      char* at = last->first;
      Free f = last->second;
      if (f.arena != static_cast<int>(a) || at + f.size != ar.base + ar.top ||
          ar.top - f.size + size > ar.cap || f.size >= size) {
        continue;
      }
      size_t need = size - (f.returned ? 0 : f.size);
      if (!fits(need)) {
        return nullptr;
      }
      grow(ar, size - f.size);
      remove_free(at);
      reserved_ += need;
      ++fresh_;
      *arena = static_cast<int>(a);
      return at;
    }
    if (!fits(size)) {
      return nullptr;
    }
    auto hit = returned_blocks_.lower_bound({size, nullptr});
    if (hit != returned_blocks_.end()) {
      reserved_ += size;
      ++fresh_;
      return split(hit->second, size, arena);
    }
    for (size_t a = 0; a < arenas_.size(); ++a) {
      if (arenas_[a].cap - arenas_[a].top >= size) {
        return extend(a, size, arena);
      }
    }
    new_arena(size);
    return extend(arenas_.size() - 1, size, arena);
  }

  bool fits(size_t need) const { return limit_ == 0 || reserved_ + need <= limit_; }

  [[noreturn]] void over_limit(size_t n) {
    c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(n), allocated_, reserved_,
                                     c10::Device(c10::DeviceType::CPU));
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: tried to allocate ", n,
                     " bytes (", mib(n), "); the caching allocator holds ", mib(allocated_),
                     " for live tensors and may reserve ", mib(limit_),
                     " (dist.memory_limit): lower the micro-batch or raise the limit");
  }

  // Under mu_: the first `size` bytes of the free block at `at`; the rest stays free as it
  // was (resident or returned).
  char* split(char* at, size_t size, int* arena) {
    Free f = free_.at(at);
    remove_free(at);
    if (f.size > size) {
      put_free(at + size, f.size - size, f.returned, f.arena);
    }
    *arena = f.arena;
    return at;
  }

  // Under mu_: `size` fresh bytes at arena `a`'s end.
  char* extend(size_t a, size_t size, int* arena) {
    Arena& ar = arenas_[a];
    grow(ar, size);
    char* at = ar.base + ar.top - size;
    reserved_ += size;
    ++fresh_;
    *arena = static_cast<int>(a);
    return at;
  }

  // Under mu_: moves `ar`'s end up by `more` bytes, making them writable.
  void grow(Arena& ar, size_t more) {
    size_t top = ar.top + more;
    if (top > ar.writable) {
      size_t to = std::min(ar.cap, round_up(top, COMMIT_STEP));
      if (mprotect(ar.base + ar.writable, to - ar.writable, PROT_READ | PROT_WRITE) != 0) {
        int err = errno;
        release_cached();
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: tried to allocate ", more,
                         " bytes (", mib(more), "): the system refused more memory: ",
                         std::strerror(err));
      }
      (void)madvise(ar.base + ar.writable, to - ar.writable, MADV_HUGEPAGE);  // advice only
      ar.writable = to;
    }
    ar.top = top;
  }

  // Under mu_: reserves address space for a new arena that holds at least `size` bytes.
  void new_arena(size_t size) {
    size_t want = std::max(ARENA_BYTES, round_up(size, HUGE_PAGE));
    for (;;) {
      void* p = mmap(nullptr, want + HUGE_PAGE, PROT_NONE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        // Huge-page aligned, so whole 2 MiB pages can back it.
        char* base = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(p), HUGE_PAGE));
        arenas_.push_back(Arena{base, want, 0, 0});
        return;
      }
      if (want / 2 < size || want <= HUGE_PAGE) {
        TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: tried to allocate ", size,
                         " bytes (", mib(size), "): no address space left: ",
                         std::strerror(errno));
      }
      want = round_up(want / 2, HUGE_PAGE);
    }
  }

  // Under mu_: frees [at, at + size) of `arena`, merged with free neighbours in the same
  // state (resident or returned).
  void add_free(char* at, size_t size, bool returned, int arena) {
    auto next = free_.find(at + size);
    if (next != free_.end() && next->second.arena == arena &&
        next->second.returned == returned) {
      size += next->second.size;
      remove_free(next->first);
    }
    auto prev = free_.lower_bound(at);
    if (prev != free_.begin()) {
      --prev;
      if (prev->first + prev->second.size == at && prev->second.arena == arena &&
          prev->second.returned == returned) {
        at = prev->first;
        size += prev->second.size;
        remove_free(at);
      }
    }
    put_free(at, size, returned, arena);
  }

  void put_free(char* at, size_t size, bool returned, int arena) {
    free_.emplace(at, Free{size, returned, arena});
    (returned ? returned_blocks_ : resident_).emplace(size, at);
  }

  void remove_free(char* at) {
    auto it = free_.find(at);
    (it->second.returned ? returned_blocks_ : resident_).erase({it->second.size, at});
    free_.erase(it);
  }

  // Under mu_: every cached page back to the system (the address space stays reserved);
  // an arena's free end is handed back to its reserve.
  void release_cached() {
    std::vector<std::pair<char*, Free>> blocks;
    for (auto& [size, at] : resident_) {
      blocks.emplace_back(at, free_.at(at));
    }
    for (auto& [at, f] : blocks) {
      (void)madvise(at, f.size, MADV_DONTNEED);
      reserved_ -= f.size;
      ++returned_;
      remove_free(at);
      add_free(at, f.size, true, f.arena);
    }
    for (size_t a = 0; a < arenas_.size(); ++a) {
      Arena& ar = arenas_[a];
      auto last = free_.lower_bound(ar.base + ar.top);
      if (last == free_.begin()) {
        continue;
      }
      --last;
      if (last->second.arena == static_cast<int>(a) && last->second.returned &&
          last->first + last->second.size == ar.base + ar.top) {
        ar.top -= last->second.size;
        remove_free(last->first);
      }
    }
  }

  std::mutex mu_;
  std::vector<Arena> arenas_;
  std::map<char*, Free> free_;            // free blocks by address
  BySize resident_;                       // free blocks whose pages are resident, by size
  BySize returned_blocks_;                // free blocks whose pages went back, by size
  std::unordered_map<void*, Live> live_;  // blocks handed out
  size_t allocated_ = 0;
  size_t reserved_ = 0;  // live blocks and resident free ones
  size_t peak_allocated_ = 0;
  size_t peak_reserved_ = 0;
  size_t limit_ = 0;  // 0: none
  uint64_t fresh_ = 0;     // requests that took pages from the system
  uint64_t returned_ = 0;  // free blocks whose pages went back to the system
};

std::mutex install_mu;
CachingCpuAllocator* installed = nullptr;  // never freed: see the top of the file

void delete_block(void* ptr) {
  installed->free(ptr);
}

char* dup(const std::string& msg) {
  char* out = static_cast<char*>(std::malloc(msg.size() + 1));
  if (out != nullptr) {
    std::memcpy(out, msg.data(), msg.size() + 1);
  }
  return out;
}

// Where the system backs every anonymous mapping with transparent huge pages
// (/sys/kernel/mm/transparent_hugepage/enabled = always), the C heap's per-thread arenas and
// thread stacks fault in whole 2 MiB pages for a few KiB used: measured 4-5 MiB more resident
// memory per rank, varying with how many huge pages the system has free, which no estimate can
// follow. Linux 6.18's PR_THP_DISABLE_EXCEPT_ADVISED limits huge pages to the mappings that ask
// for them (the arenas here, with MADV_HUGEPAGE). Older kernels refuse the flag, and nothing
// changes there.
void keep_huge_pages_to_the_arena() {
  constexpr unsigned long kExceptAdvised = 1UL << 1;  // PR_THP_DISABLE_EXCEPT_ADVISED
  (void)prctl(PR_SET_THP_DISABLE, 1UL, kExceptAdvised, 0UL, 0UL);
}

}  // namespace

extern "C" {

// Installs the caching allocator as libtorch's CPU allocator (once; later calls only set the
// limit). `limit` 0: no limit. Returns 0, or 1 with a malloc'd message in *err.
int zrun_ext_cpu_alloc_install(uint64_t limit, char** err) {
  *err = nullptr;
  try {
    std::lock_guard<std::mutex> lock(install_mu);
    if (installed == nullptr) {
      keep_huge_pages_to_the_arena();
      installed = new CachingCpuAllocator();
      c10::SetCPUAllocator(installed, PRIORITY);
      if (c10::GetCPUAllocator() != installed) {
        *err = dup("c10 kept another CPU allocator registered at a higher priority");
        return 1;
      }
    }
    installed->set_limit(static_cast<size_t>(limit));
    return 0;
  } catch (const std::exception& e) {
    *err = dup(e.what());
  }
  return 1;
}

// 1 when installed, and then out[0..7] = allocated, reserved, peak allocated, peak reserved,
// requests that took pages from the system, free blocks returned to it, limit (0: none).
int zrun_ext_cpu_alloc_stats(int64_t* out) {
  std::lock_guard<std::mutex> lock(install_mu);
  if (installed == nullptr) {
    return 0;
  }
  installed->stats(out);
  return 1;
}

void zrun_ext_cpu_alloc_reset_peak() {
  std::lock_guard<std::mutex> lock(install_mu);
  if (installed != nullptr) {
    installed->reset_peak();
  }
}

void zrun_ext_cpu_alloc_empty_cache() {
  std::lock_guard<std::mutex> lock(install_mu);
  if (installed != nullptr) {
    installed->empty_cache();
  }
}

}  // extern "C"
