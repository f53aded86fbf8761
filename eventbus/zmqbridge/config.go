package zmqbridge

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
)

// FileConfig is the bridge's JSON config file: the workers to follow and,
// optionally, the settings that flags also give (flags win).
type FileConfig struct {
	BlockSize  int          `json:"block_size,omitempty"`
	NATS       string       `json:"nats,omitempty"`
	Register   []string     `json:"register,omitempty"`
	AdminToken string       `json:"admin_token,omitempty"`
	Workers    []WorkerSpec `json:"workers"`
}

// LoadConfigFile reads and checks a config file; unknown keys are errors
// (a misspelt key would otherwise silently drop a setting).
func LoadConfigFile(path string) (FileConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return FileConfig{}, err
	}
	return ParseConfig(data)
}

// ParseConfig parses a config file's content.
func ParseConfig(data []byte) (FileConfig, error) {
	var c FileConfig
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return FileConfig{}, fmt.Errorf("bridge config: %w", err)
	}
	if dec.More() {
		return FileConfig{}, errors.New("bridge config: trailing data after the JSON object")
	}
	var errs []error
	seen := map[string]bool{}
	for i := range c.Workers {
		if err := c.Workers[i].Normalize(); err != nil {
			errs = append(errs, err)
			continue
		}
		if seen[c.Workers[i].ID] {
			errs = append(errs, fmt.Errorf("worker %s listed twice", c.Workers[i].ID))
		}
		seen[c.Workers[i].ID] = true
	}
	if c.BlockSize < 0 {
		errs = append(errs, fmt.Errorf("block_size %d", c.BlockSize))
	}
	if err := errors.Join(errs...); err != nil {
		return FileConfig{}, fmt.Errorf("bridge config: %w", err)
	}
	return c, nil
}
