// What every AMX route needs first: Linux lends a process the 8 KB of tile
// registers only once it asks, and refuses where the CPU or the hypervisor
// leaves the tile state off. Builds without tiles answer no.

#pragma once

#if defined(__AMX_TILE__)

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace llm_pte {

// The tile configuration `_tile_loadconfig` reads (palette 1): each tile's
// bytes a row and rows. A route sets the tiles it uses.
struct alignas(64) TileShapes {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
  void set(int tile, int row_bytes, int tile_rows) {
    bytes[tile] = uint16_t(row_bytes);
    rows[tile] = uint8_t(tile_rows);
  }
};

inline bool amx_allowed() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  static const bool allowed = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return allowed;
}

}  // namespace llm_pte

#else

namespace llm_pte {
inline bool amx_allowed() { return false; }  // no tiles in this build
}  // namespace llm_pte

#endif
