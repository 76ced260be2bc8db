// CRC32C (Castagnoli, reflected polynomial 0x82F63B78): the checksum of swap tiles. The SSE4.2
// `crc32` instruction when the CPU has it (checked at run time), a table-driven loop otherwise;
// both give the same value (tests check them against each other and a Python reference).
#pragma once
#include <cstdint>

namespace zc {

// CRC32C of n bytes, continuing from `crc` (0 for a fresh checksum; pass a previous result to
// extend it over more bytes). The usual pre/post inversion is applied inside.
uint32_t crc32c(const void* data, int64_t n, uint32_t crc = 0);
// The table-driven version, whatever the CPU (for tests and machines without SSE4.2).
uint32_t crc32c_scalar(const void* data, int64_t n, uint32_t crc = 0);
// Copies n bytes from src to dst (not overlapping) and returns their CRC32C continued from `crc`,
// in one pass over the data (what checkpoint writes and reads of aligned I/O buffers use).
uint32_t copy_crc32c(const void* src, void* dst, int64_t n, uint32_t crc = 0);
// The CRC32C of A || B from crc(A), crc(B) and B's length in bytes.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, uint64_t len2);
// Whether crc32c() uses the SSE4.2 instruction on this CPU.
bool crc32c_hardware();

}  // namespace zc
