package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/kvrouter/kvrouter/api/prompt"
)

// runTokenize prints, for each request body read as a JSON line on stdin,
// the token ids a replica serving the model would hash: `{"tokens":[…]}`,
// or `{"error":"…"}` for a request the model refuses. It exits 0 once it
// could read its input, whatever each request gave (docs/CONTRACTS.md), so a
// corpus can be compared line by line against the engine's own ids.
func runTokenize(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("tokenize", flag.ContinueOnError)
	fs.SetOutput(stderr)
	dir := fs.String("model-dir", "", "Hugging Face model directory (tokenizer.json, tokenizer_config.json, …)")
	completions := fs.Bool("completions", false, "bodies are /v1/completions requests (default: chat completions)")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kvrouter tokenize --model-dir DIR [--completions] < requests.jsonl")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *dir == "" || fs.NArg() > 0 {
		fs.Usage()
		return 2
	}
	m, err := prompt.Load("model", *dir)
	if err != nil {
		fmt.Fprintf(stderr, "kvrouter tokenize: %v\n", err)
		return 1
	}
	if err := tokenizeLines(m, *completions, os.Stdin, stdout); err != nil {
		fmt.Fprintf(stderr, "kvrouter tokenize: %v\n", err)
		return 1
	}
	return 0
}

// tokenizeLines answers each non-empty input line with one output line.
func tokenizeLines(m *prompt.Model, completions bool, in io.Reader, out io.Writer) error {
	sc := bufio.NewScanner(in)
	sc.Buffer(make([]byte, 0, 1<<20), 64<<20)
	w := bufio.NewWriter(out)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	for sc.Scan() {
		line := sc.Bytes()
		if len(line) == 0 {
			continue
		}
		ids, err := tokenizeBody(m, completions, line)
		if err != nil {
			_ = enc.Encode(map[string]string{"error": err.Error()})
			continue
		}
		if ids == nil {
			ids = []uint32{}
		}
		_ = enc.Encode(map[string][]uint32{"tokens": ids})
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading stdin: %w", err)
	}
	return w.Flush()
}

// tokenizeBody gives a chat body's ids, or a completions body's first
// prompt's ids (the ones the request is routed by).
func tokenizeBody(m *prompt.Model, completions bool, body []byte) ([]uint32, error) {
	if !completions {
		return m.Chat(body)
	}
	prompts, err := m.Completion(body)
	if err != nil {
		return nil, err
	}
	return prompts[0], nil
}
