#include "cpu_output_pool.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <deque>
#include <mutex>
#include <string>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace smf::cpu {
namespace {

// Outputs below this size are left to torch's allocator (glibc reuses small blocks itself).
constexpr int64_t kMinPooledBytes = int64_t(4) << 20;
// Idle bytes kept for reuse: three memory layers' fp32 value gradients at the paper's size
// (3 x 58.7 MB) and their forward outputs, with room to spare.
constexpr int64_t kMaxIdleBytes = int64_t(512) << 20;
// Blocks are 2 MB aligned and sized: the transparent huge page size on x86-64 (and arm64 with 4 KB pages).
constexpr int64_t kHugePage = int64_t(2) << 20;

struct Block {
  void* data;
  int64_t bytes;
};

class Pool {
 public:
  Block take(int64_t bytes) {
    bytes = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // The most recently freed block that fits and wastes at most a quarter of itself (both sizes
      // in whole huge pages).
      for (auto it = idle_.rbegin(); it != idle_.rend(); ++it) {
        if (it->bytes >= bytes && it->bytes - bytes <= it->bytes / 4) {
          const Block block = *it;
          idle_bytes_ -= block.bytes;
          idle_.erase(std::next(it).base());
          return block;
        }
      }
    }
    void* data = std::aligned_alloc(kHugePage, bytes);
    TORCH_CHECK(data != nullptr, "smf_kernels ext: out of memory allocating ", std::to_string(bytes),
                " bytes");  // to_string: see text() in bindings.cpp
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    madvise(data, bytes, MADV_HUGEPAGE);  // a hint: where THP is off the pages are ordinary ones
#endif
    return {data, bytes};
  }

  void give_back(Block block) {
    if (block.bytes > kMaxIdleBytes) {  // kept, it would only push every other block out
      std::free(block.data);
      return;
    }
    std::deque<Block> released;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      idle_.push_back(block);
      idle_bytes_ += block.bytes;
      while (idle_bytes_ > kMaxIdleBytes) {
        idle_bytes_ -= idle_.front().bytes;
        released.push_back(idle_.front());
        idle_.pop_front();
      }
    }
    for (const Block& old : released) std::free(old.data);
  }

  int64_t release() {
    std::deque<Block> released;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      released.swap(idle_);
      idle_bytes_ = 0;
    }
    int64_t bytes = 0;
    for (const Block& old : released) {
      bytes += old.bytes;
      std::free(old.data);
    }
    return bytes;
  }

 private:
  std::mutex mutex_;
  std::deque<Block> idle_;  // oldest first
  int64_t idle_bytes_ = 0;
};

// Never destroyed: tensors freed during interpreter shutdown may still give blocks back.
Pool& pool() {
  static Pool* instance = new Pool();
  return *instance;
}

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t bytes = c10::multiply_integers(sizes) * static_cast<int64_t>(c10::elementSize(
                                                                 c10::typeMetaToScalarType(options.dtype())));
  if (!options.device().is_cpu() || bytes < kMinPooledBytes) return at::empty(sizes, options);
  const Block block = pool().take(bytes);
  return at::from_blob(
      block.data, sizes, [block](void*) { pool().give_back(block); }, options);
}

int64_t release_idle_outputs() { return pool().release(); }

}  // namespace smf::cpu
