// A caching allocator for libtorch's CPU device, installed with c10::SetCPUAllocator.
//
// Rule (documented in src/cpu_alloc.rs too):
// - a request of 0 bytes gets a null pointer, as c10's default allocator gives;
// - a request below SMALL (64 KiB) is a 64-byte aligned block from the C heap
//   (posix_memalign): glibc's heap already keeps and reuses small blocks, so they are not
//   cached here, only counted (allocated and reserved while live);
// - a larger request is rounded up to whole pages (4 KiB) and served from the cache: the
//   smallest free block of at least that size and at most 1/8 larger (so a block is never
//   more than 12.5% larger than its request); with none, a fresh anonymous mapping (mmap,
//   page-aligned, so 64-byte aligned as c10 wants; MADV_HUGEPAGE from 2 MiB). A freed block
//   goes back to the cache, not to the system, until `empty_cache` or the limit asks.
// - with a limit, a request that would take the reserved bytes past it first returns every
//   cached block to the system, then, if still over, fails with c10::OutOfMemoryError naming
//   the bytes requested ("tried to allocate N bytes"), which callers can catch.
//
// Every block's DataPtr carries this allocator's deleter, and blocks made before it was
// installed carry the default allocator's: each is freed by the allocator that made it.
// The allocator is never destroyed (tensors may be freed during process exit).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>

namespace {

constexpr size_t SMALL = 64 << 10;
constexpr size_t PAGE = 4 << 10;
constexpr size_t HUGE_FROM = 2 << 20;
constexpr size_t ALIGN = 64;  // c10::gAlignment on x86-64
// c10's default allocator registers with priority 0; this one replaces it.
constexpr uint8_t PRIORITY = 100;

std::string mib(size_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

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
      size_t size = n < SMALL ? n : (n + PAGE - 1) / PAGE * PAGE;
      bool small = n < SMALL;
      if (!small) {
        auto it = free_.lower_bound(size);
        if (it != free_.end() && it->first <= size + size / 8) {
          size = it->first;
          ptr = it->second;
          free_.erase(it);
        }
      }
      if (ptr == nullptr) {
        if (limit_ != 0 && reserved_ + size > limit_) {
          release_cached();
          if (reserved_ + size > limit_) {
            c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(n), allocated_, reserved_,
                                             c10::Device(c10::DeviceType::CPU));
            TORCH_CHECK_WITH(OutOfMemoryError, false,
                             "CPU out of memory: tried to allocate ", n, " bytes (", mib(n),
                             "); the caching allocator holds ", mib(allocated_),
                             " for live tensors and may reserve ", mib(limit_),
                             " (dist.memory_limit): lower the micro-batch or raise the limit");
          }
        }
        ptr = small ? map_small(n) : map_large(size);
        reserved_ += size;
        peak_reserved_ = std::max(peak_reserved_, reserved_);
      }
      live_.emplace(ptr, Live{size, small});
      allocated_ += size;
      peak_allocated_ = std::max(peak_allocated_, allocated_);
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
      size = it->second.size;
      bool small = it->second.small;
      live_.erase(it);
      allocated_ -= size;
      if (small) {
        std::free(ptr);
        reserved_ -= size;
      } else {
        free_.emplace(size, ptr);
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
    out[4] = static_cast<int64_t>(mappings_);
    out[5] = static_cast<int64_t>(unmappings_);
    out[6] = static_cast<int64_t>(limit_);
  }

 private:
  struct Live {
    size_t size;
    bool small;
  };

  // Under mu_.
  void* map_small(size_t n) {
    void* ptr = nullptr;
    if (posix_memalign(&ptr, ALIGN, n) != 0 || ptr == nullptr) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: tried to allocate ", n,
                       " bytes (", mib(n), "): the C heap refused");
    }
    return ptr;
  }

  // Under mu_. A fresh mapping of `size` bytes (a multiple of PAGE).
  void* map_large(size_t size) {
    void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      // The system is short: give back what is cached and try once more.
      release_cached();
      ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (ptr == MAP_FAILED) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: tried to allocate ", size,
                       " bytes (", mib(size), "): mmap failed: ", std::strerror(errno));
    }
    if (size >= HUGE_FROM) {
      (void)madvise(ptr, size, MADV_HUGEPAGE);  // advice only: fine if refused
    }
    ++mappings_;
    return ptr;
  }

  // Under mu_: every cached block back to the system.
  void release_cached() {
    for (auto& [size, ptr] : free_) {
      munmap(ptr, size);
      reserved_ -= size;
      ++unmappings_;
    }
    free_.clear();
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;        // cached blocks by size
  std::unordered_map<void*, Live> live_;     // blocks handed out
  size_t allocated_ = 0;
  size_t reserved_ = 0;
  size_t peak_allocated_ = 0;
  size_t peak_reserved_ = 0;
  size_t limit_ = 0;  // 0: none
  uint64_t mappings_ = 0;
  uint64_t unmappings_ = 0;
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

}  // namespace

extern "C" {

// Installs the caching allocator as libtorch's CPU allocator (once; later calls only set the
// limit). `limit` 0: no limit. Returns 0, or 1 with a malloc'd message in *err.
int zrun_ext_cpu_alloc_install(uint64_t limit, char** err) {
  *err = nullptr;
  try {
    std::lock_guard<std::mutex> lock(install_mu);
    if (installed == nullptr) {
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
// mappings made, mappings returned, limit (0: none).
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
