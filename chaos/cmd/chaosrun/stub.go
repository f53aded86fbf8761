//go:build !chaos

// Command chaosrun runs the chaos scenarios; it is built with -tags chaos
// (chaos/run.sh, `make chaos`). Without the tag it only says so.
package main

import (
	"fmt"
	"os"
)

func main() {
	fmt.Fprintln(os.Stderr, "chaosrun: build with -tags chaos (use `make chaos`)")
	os.Exit(2)
}
