//go:build (amd64 || arm64) && !purego

package router

// hasPrefetch: prefetchLine is the CPU's prefetch instruction here.
const hasPrefetch = true

// prefetchLine asks the CPU to bring p's cache line in without waiting
// for it (PREFETCHT0 on amd64, PRFM PLDL1KEEP on arm64): unlike a load,
// the instruction leaves the pipeline at once, so the work after it runs
// while the line comes. It has no effect on what the program computes.
//
//go:noescape
func prefetchLine(p *tableSlot)
