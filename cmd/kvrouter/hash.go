package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"

	"github.com/kvrouter/kvrouter/router"
)

// runHash prints one line per full block: `block=I local=U64 seq=U64`, the
// contract operators use to check hash compatibility with Dynamo.
func runHash(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("hash", flag.ContinueOnError)
	fs.SetOutput(stderr)
	blockSize := fs.Int("block-size", 16, "tokens per KV block")
	lora := fs.String("lora", "", "LoRA adapter name (mixed into the hash seed)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kvrouter hash --block-size N [--lora NAME] TOKEN...")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *blockSize <= 0 {
		fmt.Fprintf(stderr, "kvrouter hash: --block-size must be positive, got %d\n", *blockSize)
		return 2
	}
	tokens := make([]uint32, 0, fs.NArg())
	for _, a := range fs.Args() {
		v, err := strconv.ParseUint(a, 10, 32)
		if err != nil {
			fmt.Fprintf(stderr, "kvrouter hash: token %q is not a u32: %v\n", a, err)
			return 2
		}
		tokens = append(tokens, uint32(v))
	}
	local, seq := router.BlockHashes(tokens, *blockSize, *lora)
	for i := range local {
		fmt.Fprintf(stdout, "block=%d local=%d seq=%d\n", i, local[i], seq[i])
	}
	if rest := len(tokens) % *blockSize; rest != 0 {
		fmt.Fprintf(stderr, "kvrouter hash: %d trailing tokens do not fill a block and are not hashed\n", rest)
	}
	return 0
}
