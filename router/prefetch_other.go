//go:build !(amd64 || arm64) || purego

package router

// hasPrefetch: no prefetch instruction here (or the purego build): the
// table's read-ahead loads the slot instead (blockTable.peek).
const hasPrefetch = false

func prefetchLine(*tableSlot) {}
