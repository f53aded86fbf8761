package main

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvrouter/kvrouter/internal/pki"
)

// Per-worker API keys (--worker-api-keys-file): engines started each with
// its own --api-key. The keys live on the replica's host, one file per key,
// named by a map file:
//
//	# worker id   key file (relative to this file's directory)
//	vllm-a        keys/vllm-a.key
//	vllm-b        /run/secrets/vllm-b
//
// Why a file here and not a key in the worker's registration: a
// registration is a Raft command, so its key would be copied into every
// replica's log and snapshots, and to whoever can read them; a registering
// worker could also name a key for another worker's id. From the map file
// a key reaches only the worker it names (every rank alike), never the
// log, /cluster/status or a log line. Workers not named get
// --worker-api-key, if any. Read at start: a changed key needs a restart.

// readWorkerKeys reads the map file at path and every key file it names.
func readWorkerKeys(path string) (map[string]pki.Secret, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--worker-api-keys-file: %w", err)
	}
	dir := filepath.Dir(path)
	keys := map[string]pki.Secret{}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		fields := strings.Fields(line)
		if len(fields) != 2 {
			return nil, fmt.Errorf("--worker-api-keys-file %s line %d: want \"<worker id> <key file>\", got %d fields", path, n, len(fields))
		}
		id, file := fields[0], fields[1]
		if strings.Contains(id, "#") {
			return nil, fmt.Errorf("--worker-api-keys-file %s line %d: worker id %q names a rank: a key is per worker, for all its ranks", path, n, id)
		}
		if _, dup := keys[id]; dup {
			return nil, fmt.Errorf("--worker-api-keys-file %s line %d: worker %q named twice", path, n, id)
		}
		if !filepath.IsAbs(file) {
			file = filepath.Join(dir, file)
		}
		k, err := pki.ReadSecretFile(file)
		if err != nil {
			return nil, fmt.Errorf("--worker-api-keys-file %s line %d (worker %q): %w", path, n, id, err)
		}
		keys[id] = k
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("--worker-api-keys-file %s: %w", path, err)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("--worker-api-keys-file %s names no worker", path)
	}
	return keys, nil
}
