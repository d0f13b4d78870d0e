// sparse_sync's compiled CPU kernels: the diff (one pass), the scatter and the block digest.
//
// Why:
// 1. The diff of a chunk reads the new and the old bits once, as 8-byte words, and for the few words
//    that changed writes the (int32 position, value) pair of each changed lane and the new word into
//    the snapshot: one pass where the framework path needs a compare, a nonzero, two gathers and a
//    scatter (each one a pass over memory).
// 2. The scatter writes pushed values at their int32 positions after checking every position is in
//    range (a bad position raises before anything is written).
// 3. The block digest is ``codec.block_digest``'s arithmetic (wrapping uint64 sums per block of
//    words, each times an odd number set by the block's position) in one pass with no temporaries.
// Values are handled as unsigned integers of their width, so no bit pattern is ever interpreted.
// Built on first use by native.py (torch.utils.cpp_extension); the Python kernels remain the fallback.

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kWordBytes = 8;

// The pairs of one changed word's changed lanes: every lane's pair is written and the count moves
// only past changed ones (no branch per lane). The caller's buffers hold one slot per element of the
// chunk, and a lane's slot is never past its element, so the writes stay inside them.
template <typename T>
inline int64_t emit_word(uint64_t now, uint64_t was, int64_t first, int32_t* pos, T* val, int64_t k) {
  constexpr int kLanes = kWordBytes / sizeof(T);
  T lanes_now[kLanes];
  T lanes_was[kLanes];
  std::memcpy(lanes_now, &now, kWordBytes);
  std::memcpy(lanes_was, &was, kWordBytes);
  for (int l = 0; l < kLanes; ++l) {
    pos[k] = static_cast<int32_t>(first + l);
    val[k] = lanes_now[l];
    k += lanes_now[l] != lanes_was[l];
  }
  return k;
}

bool avx2_supported() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // this runs from a static initializer: the CPU model may not be read yet
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

// One bit per changed word for the 64 words at a and b (bit j: word j differs).
inline uint64_t changed_words_portable(const char* a, const char* b) {
  uint64_t m = 0;
  for (int j = 0; j < 64; ++j) {
    uint64_t x, y;
    std::memcpy(&x, a + j * kWordBytes, kWordBytes);
    std::memcpy(&y, b + j * kWordBytes, kWordBytes);
    m |= static_cast<uint64_t>(x != y) << j;
  }
  return m;
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) uint64_t changed_words_avx2(const char* a, const char* b) {
  uint64_t m = 0;
  for (int j = 0; j < 64; j += 4) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + j * kWordBytes));
    const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + j * kWordBytes));
    const int same = _mm256_movemask_pd(_mm256_castsi256_pd(_mm256_cmpeq_epi64(x, y)));
    m |= static_cast<uint64_t>(~same & 0xF) << j;
  }
  return m;
}
#endif
// Whether the AVX2 kernels run: checked at run time (the build has no -march); tests also turn it off.
bool use_avx2 = avx2_supported();

inline uint64_t changed_words(const char* a, const char* b) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (use_avx2) return changed_words_avx2(a, b);
#endif
  return changed_words_portable(a, b);
}

// Word w of both sides into a (now) and b (was), and the snapshot's word set to the new one.
inline void take_word(const char* now_bytes, char* was_bytes, int64_t w, uint64_t& a, uint64_t& b) {
  std::memcpy(&a, now_bytes + w * kWordBytes, kWordBytes);
  std::memcpy(&b, was_bytes + w * kWordBytes, kWordBytes);
  std::memcpy(was_bytes + w * kWordBytes, &a, kWordBytes);
}

constexpr int64_t kGroup = 64;  // words per mask: 512 bytes, still in L1 when the changed ones are split

// The whole groups of 64 words: a mask of the changed words, then one turn per changed word.
template <typename T>
int64_t diff_groups(const char* now_bytes, char* was_bytes, int64_t groups, int32_t* pos, T* val) {
  constexpr int64_t kLanes = kWordBytes / sizeof(T);
  int64_t k = 0;
  for (int64_t w0 = 0; w0 < groups * kGroup; w0 += kGroup) {
    uint64_t mask = changed_words(now_bytes + w0 * kWordBytes, was_bytes + w0 * kWordBytes);
    while (mask) {
      const int64_t w = w0 + __builtin_ctzll(mask);
      mask &= mask - 1;
      uint64_t a, b;
      take_word(now_bytes, was_bytes, w, a, b);
      k = emit_word<T>(a, b, w * kLanes, pos, val, k);
    }
  }
  return k;
}

#if defined(__x86_64__) && defined(__GNUC__)
// 2-byte lanes (bf16, fp16) with AVX2: a changed word's lane pattern comes from one 16-bit compare,
// and a table turns it into the shuffle that packs the changed values and the lanes' offsets
// (x86 is little-endian: lane l is bytes 2l and 2l + 1).
struct Lanes16 {
  alignas(16) uint8_t shuffle[256][16];
  alignas(16) int32_t offset[256][4];
  uint8_t count[256];
  Lanes16() {
    for (int p = 0; p < 256; ++p) {  // p: the byte mask of differing bytes of the word
      int c = 0;
      for (int j = 0; j < 16; ++j) shuffle[p][j] = 0x80;  // 0x80: a zero byte
      for (int j = 0; j < 4; ++j) offset[p][j] = 0;
      for (int l = 0; l < 4; ++l) {
        if (!((p >> (2 * l)) & 3)) continue;
        shuffle[p][2 * c] = static_cast<uint8_t>(2 * l);
        shuffle[p][2 * c + 1] = static_cast<uint8_t>(2 * l + 1);
        offset[p][c++] = l;
      }
      count[p] = static_cast<uint8_t>(c);
    }
  }
};
const Lanes16 kLanes16;

__attribute__((target("avx2"))) int64_t diff_groups16_avx2(const char* now_bytes, char* was_bytes, int64_t groups,
                                                          int32_t* pos, uint16_t* val) {
  int64_t k = 0;
  for (int64_t w0 = 0; w0 < groups * kGroup; w0 += kGroup) {
    uint64_t mask = changed_words_avx2(now_bytes + w0 * kWordBytes, was_bytes + w0 * kWordBytes);
    while (mask) {
      const int64_t w = w0 + __builtin_ctzll(mask);
      mask &= mask - 1;
      uint64_t a, b;
      take_word(now_bytes, was_bytes, w, a, b);
      const __m128i now = _mm_cvtsi64_si128(static_cast<long long>(a));
      const __m128i was = _mm_cvtsi64_si128(static_cast<long long>(b));
      const unsigned p = ~static_cast<unsigned>(_mm_movemask_epi8(_mm_cmpeq_epi16(now, was))) & 0xFF;
      const __m128i packed = _mm_shuffle_epi8(now, _mm_load_si128(reinterpret_cast<const __m128i*>(kLanes16.shuffle[p])));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(val + k), packed);  // 4 slots written, count[p] kept
      const __m128i lanes = _mm_load_si128(reinterpret_cast<const __m128i*>(kLanes16.offset[p]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(pos + k), _mm_add_epi32(_mm_set1_epi32(static_cast<int>(w * 4)), lanes));
      k += kLanes16.count[p];
    }
  }
  return k;
}
#endif

template <typename T>
int64_t diff_update_impl(const T* now, T* was, int64_t n, int32_t* pos, T* val) {
  constexpr int64_t kLanes = kWordBytes / sizeof(T);
  const char* now_bytes = reinterpret_cast<const char*>(now);
  char* was_bytes = reinterpret_cast<char*>(was);
  const int64_t words = n / kLanes, groups = words / kGroup;
  int64_t k = -1;
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (sizeof(T) == 2) {
    if (use_avx2) k = diff_groups16_avx2(now_bytes, was_bytes, groups, pos, reinterpret_cast<uint16_t*>(val));
  }
#endif
  if (k < 0) k = diff_groups<T>(now_bytes, was_bytes, groups, pos, val);
  for (int64_t w = groups * kGroup; w < words; ++w) {
    uint64_t a, b;
    std::memcpy(&a, now_bytes + w * kWordBytes, kWordBytes);
    std::memcpy(&b, was_bytes + w * kWordBytes, kWordBytes);
    if (a == b) continue;
    std::memcpy(was_bytes + w * kWordBytes, &a, kWordBytes);
    k = emit_word<T>(a, b, w * kLanes, pos, val, k);
  }
  for (int64_t i = words * kLanes; i < n; ++i) {  // the elements after the last whole word
    if (now[i] == was[i]) continue;
    pos[k] = static_cast<int32_t>(i);
    val[k] = now[i];
    was[i] = now[i];
    ++k;
  }
  return k;
}

template <typename T>
void scatter_impl(T* target, int64_t n, const int32_t* idx, const T* val, int64_t k) {
  uint32_t worst = 0;
  for (int64_t i = 0; i < k; ++i) {  // a negative position reads as a huge unsigned one
    const uint32_t p = static_cast<uint32_t>(idx[i]);
    worst = p > worst ? p : worst;
  }
  TORCH_CHECK(k == 0 || static_cast<int64_t>(worst) < n, "sparse_sync scatter: position ", static_cast<int64_t>(worst),
              " (or a negative one) is outside the ", n, " elements of the target; nothing was written");
  for (int64_t i = 0; i < k; ++i) target[idx[i]] = val[i];
}

void check_flat(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 1, "sparse_sync kernels: ", what,
              " must be a flat contiguous CPU tensor");
}

int64_t diff_update(const torch::Tensor& now, const torch::Tensor& was, const torch::Tensor& pos,
                    const torch::Tensor& val) {
  check_flat(now, "new");
  check_flat(was, "old");
  check_flat(pos, "positions");
  check_flat(val, "values");
  const int64_t n = now.numel();
  const int64_t size = now.element_size();
  TORCH_CHECK(was.numel() == n && was.scalar_type() == now.scalar_type() && val.scalar_type() == now.scalar_type(),
              "sparse_sync diff: new, old and values must share one dtype, new and old one length");
  TORCH_CHECK(pos.scalar_type() == torch::kInt32 && pos.numel() >= n && val.numel() >= n,
              "sparse_sync diff: the int32 positions and the values need room for every element");
  TORCH_CHECK(n <= INT32_MAX, "sparse_sync diff: a chunk must fit int32 positions");
  switch (size) {
    case 1: return diff_update_impl(static_cast<const uint8_t*>(now.data_ptr()), static_cast<uint8_t*>(was.data_ptr()),
                                    n, pos.data_ptr<int32_t>(), static_cast<uint8_t*>(val.data_ptr()));
    case 2: return diff_update_impl(static_cast<const uint16_t*>(now.data_ptr()), static_cast<uint16_t*>(was.data_ptr()),
                                    n, pos.data_ptr<int32_t>(), static_cast<uint16_t*>(val.data_ptr()));
    case 4: return diff_update_impl(static_cast<const uint32_t*>(now.data_ptr()), static_cast<uint32_t*>(was.data_ptr()),
                                    n, pos.data_ptr<int32_t>(), static_cast<uint32_t*>(val.data_ptr()));
    case 8: return diff_update_impl(static_cast<const uint64_t*>(now.data_ptr()), static_cast<uint64_t*>(was.data_ptr()),
                                    n, pos.data_ptr<int32_t>(), static_cast<uint64_t*>(val.data_ptr()));
    default: TORCH_CHECK(false, "sparse_sync diff: element size ", size, " is not 1, 2, 4 or 8 bytes");
  }
  return 0;
}

void scatter(const torch::Tensor& target, const torch::Tensor& idx, const torch::Tensor& val) {
  check_flat(target, "target");
  check_flat(idx, "positions");
  check_flat(val, "values");
  TORCH_CHECK(idx.scalar_type() == torch::kInt32 && idx.numel() == val.numel() &&
              val.scalar_type() == target.scalar_type(),
              "sparse_sync scatter: int32 positions, as many values as positions, values of the target's dtype");
  const int64_t n = target.numel(), k = idx.numel();
  const int32_t* p = idx.data_ptr<int32_t>();
  switch (target.element_size()) {
    case 1: scatter_impl(static_cast<uint8_t*>(target.data_ptr()), n, p, static_cast<const uint8_t*>(val.data_ptr()), k); break;
    case 2: scatter_impl(static_cast<uint16_t*>(target.data_ptr()), n, p, static_cast<const uint16_t*>(val.data_ptr()), k); break;
    case 4: scatter_impl(static_cast<uint32_t*>(target.data_ptr()), n, p, static_cast<const uint32_t*>(val.data_ptr()), k); break;
    case 8: scatter_impl(static_cast<uint64_t*>(target.data_ptr()), n, p, static_cast<const uint64_t*>(val.data_ptr()), k); break;
    default: TORCH_CHECK(false, "sparse_sync scatter: element size ", target.element_size(), " is not 1, 2, 4 or 8 bytes");
  }
}

// (mixed, rest) of codec.block_digest over int64 words, as int64 bit patterns of the uint64 results.
std::vector<int64_t> block_digest(const torch::Tensor& words, int64_t block) {
  check_flat(words, "words");
  TORCH_CHECK(words.scalar_type() == torch::kInt64 && block > 0, "sparse_sync digest: int64 words, block > 0");
  const uint64_t* w = static_cast<const uint64_t*>(words.data_ptr());
  const int64_t n = words.numel(), full = n / block;
  uint64_t mixed = 0, rest = 0;
  for (int64_t b = 0; b < full; ++b) {
    uint64_t sum = 0;
    const uint64_t* row = w + b * block;
    for (int64_t j = 0; j < block; ++j) sum += row[j];
    mixed += sum * static_cast<uint64_t>(2 * b + 1);
  }
  for (int64_t j = full * block; j < n; ++j) rest += w[j];
  return {static_cast<int64_t>(mixed), static_cast<int64_t>(rest)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto unlocked = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("diff_update", &diff_update, unlocked, "changed lanes of new vs old: positions, values, snapshot updated");
  m.def("scatter", &scatter, unlocked, "target[positions] = values, positions checked first");
  m.def("block_digest", &block_digest, unlocked, "codec.block_digest's (mixed, rest) over int64 words");
  m.def("set_avx2", [](bool on) { use_avx2 = on && avx2_supported(); return use_avx2; },
        "run the AVX2 kernels (where the CPU has them) or the portable ones; returns what runs now");
}
