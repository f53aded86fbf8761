//go:build !linux

package router

// Only Linux is asked for huge pages (hugepages_linux.go).

func adviseHugePages([]tableSlot) {}

func collapseHugePages([]tableSlot) {}
